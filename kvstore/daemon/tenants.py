"""Tenants of ``kvstore serve``: which bearer token is whom, in what role, bound to which salt.

A tenants file (``kvstore serve --tenants-file FILE``; YAML ``.yaml``/``.yml``, TOML ``.toml``
or JSON ``.json``) maps tenant names to their settings::

    tenants:
      alice: {token: "a-long-random-secret-1", role: tenant}                 # salt "alice"
      bob:   {token: "a-long-random-secret-2", role: tenant, salt: "team-b"}
      dash:  {token: "a-long-random-secret-3", role: reader, salt: "alice"}  # reads alice's
      ops:   {token: "a-long-random-secret-4", role: admin}

Roles:

* ``admin``: every route and every namespace, ``clear {"all": true}``, ``/v1/stats`` and
  ``/metrics`` (aggregates over all tenants).
* ``tenant``: lookup, exists, get, put, remove, demote, clear, pin and unpin in its own namespaces.
* ``reader``: lookup, exists and get in its own namespaces.

**The binding.** A tenant's namespaces are those whose ``cache_salt`` is its salt ``S`` or starts
with ``S + "/"`` (sub-salts: e.g. vLLM's per-request ``cache_salt`` under the tenant's salt);
any other namespace in a request is refused with 403, and so is every key, since a key's first
16 bytes are its namespace's id (``kvstore.daemon.protocol.parse_key``). The server checks rather than
rewrites: a key is a hash chain the client computes from the token ids, seeded by the
namespace digest, which includes ``cache_salt``; the server never sees the token ids, so it
cannot re-key a chunk under another salt. It can only refuse namespaces that do not carry the
caller's salt, and tell the client which salt to use: ``GET /v1/whoami`` answers
``{"tenant", "role", "cache_salt"}`` (``cache_salt`` null for an unbound admin), and the
connectors build their namespaces with it. Knowing another tenant's salt is therefore useless:
the token, not the salt, decides what a client may name.

**What a shared namespace trusts.** Chunk keys hash token ids, not KV bytes: the first writer
of a key decides what every later reader of that key in that namespace loads. Tenants that are
given the same salt (and admins, who may write anywhere) share their namespaces, and each of
them trusts every other one not to write wrong KV. The unsalted namespace (``cache_salt ""``)
is the namespace of a tenant configured with ``salt: ""`` and of clients of a daemon without
tenants; a tenant with its own salt can neither read nor write it.

Tokens: 16 to 4096 characters of printable ASCII without spaces, unique; compared in constant
time against every tenant's token (no early exit), never logged (``Tenant``'s repr omits it).
The single ``--auth-token`` mode is one admin tenant named ``admin``.
"""
from __future__ import annotations

import difflib
import hmac
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

ROLES = ("admin", "tenant", "reader")
READ, WRITE = "read", "write"
MIN_TOKEN_CHARS = 16
#: longest token: a client sends it in one header line, which an HTTP server caps (aiohttp:
#: 8190 bytes with ``Authorization: Bearer ``, so 8168 characters); a longer token could never
#: authenticate
MAX_TOKEN_CHARS = 4096
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
_TOKEN = re.compile(r"[\x21-\x7e]+")


class Forbidden(Exception):
    """An authenticated caller asked for something its role or salt does not allow (403)."""


@dataclass(frozen=True)
class Tenant:
    """One credential of the daemon.

    Attributes:
        name: tenant name (letters, digits, ``_.@-``; at most 64 characters).
        role: ``admin``, ``tenant`` or ``reader``.
        salt: the ``cache_salt`` its namespaces carry (sub-salts ``salt/...`` too); None for an
            admin bound to no salt (``whoami`` then says null and clients keep their own).
        token: the bearer token (not in the repr).
    """

    name: str
    role: str
    salt: str | None
    token: str = field(repr=False)

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def owns(self, cache_salt: str) -> bool:
        """Whether a namespace with ``cache_salt`` is this tenant's (admins: every one)."""
        if self.is_admin:
            return True
        return cache_salt == self.salt or cache_salt.startswith(self.salt + "/")

    def check(self, cache_salt: str, access: str) -> None:
        """Allow ``access`` (``READ`` or ``WRITE``) to a namespace with ``cache_salt``.

        Raises:
            Forbidden: a namespace of another salt, or a write by a reader.
        """
        if access == WRITE and self.role == "reader":
            raise Forbidden(f"tenant {self.name!r} has the read-only role")
        if not self.owns(cache_salt):
            raise Forbidden(f"tenant {self.name!r} may only name namespaces with cache_salt "
                            f"{self.salt!r} (or {self.salt + '/'!r}...); ask GET /v1/whoami")

    def require_admin(self, what: str) -> None:
        """Raises Forbidden unless this is an admin."""
        if not self.is_admin:
            raise Forbidden(f"{what} needs an admin token (tenant {self.name!r} is {self.role})")

    def whoami(self) -> dict:
        """The ``/v1/whoami`` answer."""
        return {"tenant": self.name, "role": self.role, "cache_salt": self.salt}


#: The caller of a daemon without any token (loopback or ``--insecure``): unrestricted.
OPEN = Tenant("anonymous", "admin", None, "")


class TenantTable:
    """The daemon's credentials; ``authenticate`` maps an ``Authorization`` header to a tenant.

    Raises:
        ValueError: no tenants, or two tenants with the same token.
    """

    def __init__(self, tenants: list[Tenant]) -> None:
        if not tenants:
            raise ValueError("a tenant table needs at least one tenant")
        tokens = [t.token for t in tenants]
        if len(set(tokens)) != len(tokens):
            raise ValueError("two tenants share a token; each tenant needs its own")
        self.tenants = tuple(tenants)
        self._tokens = [(t.token.encode(), t) for t in tenants]

    def __len__(self) -> int:
        return len(self.tenants)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant whose token the header ``Bearer TOKEN`` carries, else None. Every token
        is compared (``hmac.compare_digest``, no early exit), so the time taken does not tell
        which one, or how much of one, matched; a header that is not ASCII matches none."""
        scheme, _, value = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        try:
            presented = value.strip().encode("ascii")
        except UnicodeEncodeError:
            return None
        found = None
        for token, tenant in self._tokens:
            if hmac.compare_digest(presented, token):
                found = tenant
        return found

    @classmethod
    def single(cls, token: str) -> "TenantTable":
        """The ``--auth-token`` mode: one admin named ``admin``, bound to no salt (any token
        length from 1 to ``MAX_TOKEN_CHARS`` is accepted, as before tenants existed).

        Raises:
            ValueError: a token no client could present in an ``Authorization`` header:
                empty, over ``MAX_TOKEN_CHARS``, not printable ASCII, or with leading or
                trailing spaces (``authenticate`` strips them).
        """
        if not (0 < len(token) <= MAX_TOKEN_CHARS and token.isascii() and token.isprintable()
                and token == token.strip()):
            raise ValueError(f"--auth-token must be 1 to {MAX_TOKEN_CHARS} printable ASCII "
                             f"characters without leading or trailing spaces: no client "
                             f"could send this one")
        return cls([Tenant("admin", "admin", None, token)])

    @classmethod
    def from_mapping(cls, data: Any, where: str = "tenants") -> "TenantTable":
        """Build from ``{"tenants": {name: {token, role, salt?}}}`` (or the inner mapping).

        Raises:
            ValueError: not a mapping, an unknown top-level key (beside ``tenants``, or a
                misspelling of it), an unknown field or role, a bad or non-string name, a
                token shorter than ``MIN_TOKEN_CHARS``, longer than ``MAX_TOKEN_CHARS`` or with
                spaces or non-ASCII, a salt with ``/`` or not
                a string, duplicate tokens; the message names the tenant, never a token.
        """
        if isinstance(data, Mapping) and "tenants" in data:
            other = sorted(map(str, set(data) - {"tenants"}))
            if other:
                raise ValueError(f"{where}: unknown top-level key {other[0][:80]!r}; the file "
                                 f"holds only 'tenants:'")
            data = data["tenants"]
        elif isinstance(data, Mapping):  # the inner mapping; a misspelt 'tenants:' is no tenant
            for name, spec in data.items():  # (a tenant named so has a token)
                if (isinstance(name, str) and isinstance(spec, Mapping) and "token" not in spec
                        and difflib.get_close_matches(name.lower(), ["tenants"], cutoff=0.75)):
                    raise ValueError(f"{where}: unknown top-level key {name[:80]!r}; did you "
                                     f"mean 'tenants'?")
        if not isinstance(data, Mapping) or not data:
            got = "an empty mapping" if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"{where}: expected a non-empty mapping 'tenants: {{name: {{token, "
                             f"role, salt}}}}' (e.g. 'tenants:' then '  alice: {{token: ..., "
                             f"role: tenant}}' on the next line), got {got}")
        return cls([_tenant(name, spec, where) for name, spec in data.items()])

    @classmethod
    def from_file(cls, path: str | Path) -> "TenantTable":
        """Read a YAML, TOML or JSON tenants file (by suffix; YAML otherwise).

        Raises:
            ValueError: unreadable or malformed file, a key twice in one mapping (e.g. a tenant
                defined twice: the message names it and its line), or any error of
                ``from_mapping``.
        """
        p = Path(path)
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read tenants file {p}: {e}") from None
        try:
            if p.suffix == ".toml":  # (tomllib refuses a key defined twice itself)
                import tomllib
                data = tomllib.loads(text)
            elif p.suffix == ".json":
                data = json.loads(text, object_pairs_hook=_unique_pairs)
            else:
                data = _yaml_load_unique(text)
        except Exception as e:  # noqa: BLE001 - tomllib/json/yaml each raise their own error
            raise ValueError(f"malformed tenants file {p}: {_parse_error(e)}") from None
        return cls.from_mapping(data, str(p))


class DuplicateKeyError(ValueError):
    """A JSON object with one key twice (``_unique_pairs``)."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads``'s ``object_pairs_hook``: the object as a dict; raises
    ``DuplicateKeyError`` naming a key that appears twice (JSON keeps the last one silently)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(f"duplicate key {k[:80]!r}")
        out[k] = v
    return out


def _yaml_load_unique(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key twice in one mapping (PyYAML keeps the last one
    silently): raises ``yaml.constructor.ConstructorError`` naming the key and its line. A
    key that overrides one merged in (``<<: *base``) is no duplicate (YAML's merge rule)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # merged keys may be overridden; each mapping checks its own
                    key = self.construct_object(key_node, deep=deep)
                    try:
                        twice = key in seen
                    except TypeError:  # an unhashable key: the base class reports it
                        break
                    if twice:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping", node.start_mark,
                            f"found duplicate key {str(key)[:80]!r}", key_node.start_mark)
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _parse_error(e: Exception) -> str:
    """The kind and position of a YAML/JSON/TOML parse error, without the file's text (the
    error's own message may quote a line holding a token; tomllib's names at most a key or one
    character)."""
    mark = getattr(e, "problem_mark", None)  # yaml.MarkedYAMLError
    if mark is not None:
        return f"{type(e).__name__} at line {mark.line + 1}, column {mark.column + 1}: {e.problem}"
    if isinstance(e, DuplicateKeyError):
        return f"{e}"
    if isinstance(e, json.JSONDecodeError):
        return f"{type(e).__name__} at line {e.lineno}, column {e.colno}: {e.msg}"
    if type(e).__name__ == "TOMLDecodeError":  # "Invalid value (at line 2, column 5)"
        return f"{type(e).__name__}: {e}"
    return type(e).__name__


def bind_salt(tenant_salt: str | None, salt: str = "") -> str:
    """The ``cache_salt`` a client bound to ``tenant_salt`` (``whoami``) names for its own
    ``salt``: ``salt`` itself when unbound (None) or already the tenant's; the tenant's salt
    when ``salt`` is empty; else the sub-salt ``tenant_salt + "/" + salt``."""
    if tenant_salt is None or salt == tenant_salt or salt.startswith(tenant_salt + "/"):
        return salt
    return tenant_salt if not salt else f"{tenant_salt}/{salt}"


def _tenant(name: Any, spec: Any, where: str) -> Tenant:
    if not isinstance(name, str):  # YAML reads an unquoted true, yes, on, null, 1.0 as non-strings
        raise ValueError(f"{where}: tenant name {name!r} is not a string (quote it in YAML)")
    if not _NAME.fullmatch(name):
        raise ValueError(f"{where}: tenant name {name[:80]!r} must be 1-64 letters, digits or "
                         f"'_.@-'")
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: tenant {name!r} must map to {{token, role, salt}}")
    unknown = sorted(set(spec) - {"token", "role", "salt"})
    if unknown:
        raise ValueError(f"{where}: tenant {name!r} has unknown fields {unknown}; known: "
                         f"token, role, salt")
    token, role = spec.get("token"), spec.get("role", "tenant")
    if (not isinstance(token, str) or not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS
            or not _TOKEN.fullmatch(token)):
        raise ValueError(f"{where}: tenant {name!r} needs a token of {MIN_TOKEN_CHARS} to "
                         f"{MAX_TOKEN_CHARS} printable ASCII characters without spaces")
    if role not in ROLES:
        raise ValueError(f"{where}: tenant {name!r} has role {role!r}; choose one of {ROLES}")
    salt = spec.get("salt", None if role == "admin" else name)
    if (salt is None and role != "admin") or (salt is not None and (
            not isinstance(salt, str) or "/" in salt)):
        raise ValueError(f"{where}: tenant {name!r}: salt must be a string without '/'")
    return Tenant(name, role, salt, token)
