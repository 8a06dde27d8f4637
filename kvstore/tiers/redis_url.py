"""Parse the remote tier's Redis address: ``redis://[user:password@]host:port[,host:port...]``.

One address names a standalone server; several name startup nodes of a Redis Cluster (the rest
of the cluster is discovered from them). ``rediss://`` asks for TLS, verifying the server's
certificate against the system's CAs, or against a private CA given as a query parameter
(redis-py's names): ``rediss://h:p?ssl_ca_certs=/etc/kvstore/ca.crt``, with
``ssl_certfile`` and ``ssl_keyfile`` for a client certificate (Redis's ``tls-auth-clients
yes``) and ``ssl_cert_reqs`` (``required``, the default, ``optional`` or ``none``; ``none``
skips verification). The files must exist. A standalone address may end in ``/<db>``. The password may come from the URL, from ``KVSTORE_REMOTE_PASSWORD`` or from
the caller; it is never part of ``str()``/``repr()`` of the result (``redacted``), so logging
an endpoint never logs a password.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote

PASSWORD_ENV = "KVSTORE_REMOTE_PASSWORD"
DEFAULT_PORT = 6379
#: TLS query parameters of a ``rediss://`` URL (redis-py's names), in order; the first three
#: name files
TLS_PARAMS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
CERT_REQS = ("required", "optional", "none")


def _tls_options(query: str, tls: bool) -> tuple[tuple[str, str], ...]:
    """The TLS query parameters of a URL's ``query`` (after ``?``), checked."""
    if not query:
        return ()
    if not tls:
        raise ValueError("remote URL: query parameters (TLS settings) need rediss://")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise ValueError(f"remote URL: cannot parse the query {query!r} "
                         f"(name=value&name=value)") from None
    given: dict[str, str] = {}
    for name, value in pairs:
        if name not in TLS_PARAMS:
            raise ValueError(f"remote URL: unknown parameter {name!r}; known: "
                             f"{', '.join(TLS_PARAMS)}")
        if name in given:
            raise ValueError(f"remote URL: parameter {name!r} given twice")
        if name == "ssl_cert_reqs":
            if value not in CERT_REQS:
                raise ValueError(f"remote URL: ssl_cert_reqs must be one of "
                                 f"{', '.join(CERT_REQS)}, got {value!r}")
        elif not os.path.isfile(value):
            raise ValueError(f"remote URL: {name} file {value!r} not found")
        given[name] = value
    if ("ssl_keyfile" in given) != ("ssl_certfile" in given):
        raise ValueError("remote URL: ssl_certfile and ssl_keyfile go together (a client "
                         "certificate and its key)")
    return tuple((k, given[k]) for k in TLS_PARAMS if k in given)


@dataclass(frozen=True)
class RedisEndpoint:
    """Where the remote tier's Redis lives.

    Attributes:
        nodes: ``(host, port)`` of each startup node (one: standalone or a cluster's seed).
        username: ACL user (``""``: the default user).
        password: the password (``None``: none); not shown by ``repr``.
        tls: ``rediss://``.
        db: database number (standalone only).
        tls_options: the URL's TLS query parameters, ``((name, value), ...)`` in
            ``TLS_PARAMS`` order (only with ``tls``).
    """

    nodes: tuple[tuple[str, int], ...]
    username: str = ""
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    db: int = 0
    tls_options: tuple[tuple[str, str], ...] = ()

    def ssl_kwargs(self) -> dict:
        """``redis.Redis``/``RedisCluster`` keyword arguments of the TLS settings."""
        return {"ssl": self.tls, **dict(self.tls_options)} if self.tls else {"ssl": False}

    def _query(self) -> str:
        return ("?" + "&".join(f"{k}={quote(v, safe='/')}" for k, v in self.tls_options)
                if self.tls_options else "")

    def redacted(self) -> str:
        """The URL without its password (``redis://user:***@h:p,h:p``)."""
        scheme = "rediss" if self.tls else "redis"
        auth = ""
        if self.username or self.password:
            auth = f"{self.username}{':***' if self.password else ''}@"
        return (f"{scheme}://{auth}{self._hosts()}" + (f"/{self.db}" if self.db else "")
                + self._query())

    def _hosts(self) -> str:
        return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)

    def __str__(self) -> str:
        return self.redacted()

    def without_password(self) -> str:
        """The URL with the user but no password (to keep in configs that may be logged)."""
        scheme = "rediss" if self.tls else "redis"
        auth = f"{self.username}@" if self.username else ""
        return (f"{scheme}://{auth}{self._hosts()}" + (f"/{self.db}" if self.db else "")
                + self._query())


def parse_redis_url(url: str, password: str | None = None,
                    env: dict | None = None) -> RedisEndpoint:
    """Parse ``url`` (see module docstring). ``password`` (or ``$KVSTORE_REMOTE_PASSWORD``)
    applies when the URL carries none.

    Raises:
        ValueError: another scheme, no host, a bad port, a db with several nodes, a bad db,
            or bad TLS parameters (unknown, twice, a file not found, without rediss://).
            The message never contains the password.
    """
    env = os.environ if env is None else env
    if not isinstance(url, str) or "://" not in url:
        raise ValueError("remote URL must look like redis://[user:password@]host:port[,host:port]")
    scheme, rest = url.split("://", 1)
    if scheme not in ("redis", "rediss"):
        raise ValueError(f"remote URL scheme must be redis:// or rediss://, got {scheme}://")
    rest, _, query = rest.partition("?")
    tls_options = _tls_options(query, scheme == "rediss")
    user, pw = "", None
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
        if "@" in auth:
            raise ValueError("remote URL: one user:password@ before all the nodes "
                             "(redis://user:password@h1:p1,h2:p2); percent-encode an '@' in a "
                             "password")
        user, sep, pw_text = auth.partition(":")
        user = unquote(user)
        pw = unquote(pw_text) if sep else None
    db = 0
    if "/" in rest:
        rest, db_text = rest.split("/", 1)
        if db_text:
            try:
                db = int(db_text)
            except ValueError:
                raise ValueError(f"remote URL database must be a number, got {db_text!r}") from None
            if db < 0:
                raise ValueError(f"remote URL database must be >= 0, got {db}")
    nodes = []
    for part in rest.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("["):  # IPv6: [addr] or [addr]:port
            host, close, tail = part[1:].partition("]")
            if not close or (tail and not tail.startswith(":")):
                raise ValueError(f"remote URL node {part!r}: an IPv6 address is written [addr]:port")
            port_text = tail[1:] if tail else str(DEFAULT_PORT)
        else:
            host, sep, port_text = part.rpartition(":")
            if not sep:
                host, port_text = part, str(DEFAULT_PORT)
            if ":" in host:
                raise ValueError(f"remote URL node {part!r}: an IPv6 address is written "
                                 f"[addr]:port")
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"remote URL port must be a number, got {port_text!r}") from None
        if not host or not 0 < port < 65536:
            raise ValueError(f"remote URL node {host or '?'}:{port_text} is not host:port")
        nodes.append((host, port))
    if not nodes:
        raise ValueError("remote URL names no host")
    if db and len(nodes) > 1:
        raise ValueError("a Redis Cluster has only database 0; drop /<db> from the remote URL")
    if pw is None:
        pw = password if password is not None else env.get(PASSWORD_ENV) or None
    return RedisEndpoint(tuple(nodes), user, pw, scheme == "rediss", db, tls_options)
