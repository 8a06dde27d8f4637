"""What a shared kvstore daemon holds of a prompt, and how that discounts the engines' own hits.

When the engines load from one kvstore daemon (``--kvstore-url`` on the engines and on the
router), a prompt's tokens the store holds are loadable by every engine sharing it, so they do
not tell the engines apart: an engine's advantage is only what its own prefix cache holds
beyond the store. Per request, for each store namespace among the healthy engines (read once
from each engine's ``GET /debug/stats`` field ``store_namespace``), the router asks the daemon
``POST /v1/lookup`` for the prompt's chunk keys (``Namespace.chunk_keys``, the keys the
engine's connector saves under, through ``connectors.prompt_keys``: the router imports nothing
of ``kvstore`` itself) and gets ``store_hit = num_hit_chunks x chunk_size`` tokens. The
lookup has a deadline (default 5 ms); on a timeout or an error the request is scored without
the store (``router_store_lookups_total{result}``).

At start, ``check_token`` asks the daemon's ``GET /v1/whoami`` with the router's token (as
an engine's connector does at its start): a daemon that refuses it (401, 403: a wrong or
missing ``--kvstore-auth-token``) would refuse every lookup, so the router runs without the
store, with one warning (as ``engine_min serve`` runs without it).

Whether the daemon answers is logged: ``StoreLookup.watch`` (started with the router) asks
its ``GET /v1/whoami`` (with the token: a refused token counts as down) at start and every
``probe_interval_s``, so a daemon that is down is
reported even while every lookup is skipped, and its return too; a lookup that fails (refused,
HTTP error) marks it down at once. A warning when it goes down (at most one per
``warn_interval_s``: an outage within it is logged by a later probe), an INFO line when it
answers again after a logged outage; timeouts of the (ms) lookup deadline
alone do not count as down.

``discount_store_hits`` turns the candidates' local hits into advantages over the store::

    s_e        = store hit tokens in engine e's namespace (0: e uses no store, or the lookup
                 was skipped)
    score_e    = max(0, hit_tokens_e - s_e)         what e holds that the store does not
    remainder  = num_prompt_tokens - min(s_e)        tokens the store cannot give every engine

and the policy runs on ``score`` and ``remainder`` unchanged (``engine_min.router.policy``):
an engine wins on its cache only if it holds more beyond the store than another engine does
and at least ``min_hit_fraction`` of the remainder; otherwise (the store holds as much as any
engine) the least-loaded engine gets the request, and loads the prefix from the store.

When the store holds as much as any engine and the pick falls back to load, the least-loaded
engine holding the most itself is taken among equally loaded ones (``choose_with_store``).

The lookup is skipped (``result="skipped"``) when every healthy engine saves to one namespace
and the store cannot change the pick (``store_can_change_pick``): none wins on its own hits
without the store (with one store hit ``s`` for all, an engine wins on
``max(0, h - s) >= f (n - s)`` only if ``h >= f n + (1 - f) s >= f n``, and equal hits stay
equal, so the store cannot make an engine win: a new conversation's first round), or an engine
that wins on its hits is also among the least loaded (with the store it still wins, or the
least-loaded fallback takes it, as it holds the most), or the same engines win on their hits
whatever the store answers. The answer is whole chunks of the prompt, ``0 <= s <= s_max``
(``s_max``: the prompt's full chunks); an engine set ``W`` that wins at ``s = 0`` and at
``s_max`` wins at every ``s`` between: with ``H`` the winners' hit, ``H - s_max > 0`` (a winner
holds more than the least), so every winner keeps ``score = H - s``, the most among the
eligible engines (loads do not depend on ``s``), above every other score, and
``H - s >= f (n - s)`` is linear in ``s``, true at both ends. A later round of a chat whose
history fills the prompt's last, partial chunk (which the store cannot hold: ``n - s_max >=
(question tokens) / (1 - f)``) is routed to the engine holding the history without a lookup,
even when that engine is busier.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Mapping

import aiohttp

from engine_min.router.lookup_conn import LookupConnections
from engine_min.router.metrics import RouterMetrics
from engine_min.router.policy import LOAD, Candidate, Decision

logger = logging.getLogger("engine_min.router")

#: default deadline of one request's store lookups (seconds)
DEFAULT_LOOKUP_TIMEOUT_S = 0.005


def discount_store_hits(candidates: Iterable[Candidate], store_hits: Mapping[int, int],
                        num_prompt_tokens: int) -> tuple[list[Candidate], int]:
    """``(candidates scored beyond the store, remainder)`` as in the module's formula.

    Args:
        candidates: the healthy engines with their local ``hit_tokens``.
        store_hits: store hit tokens per candidate ``position`` (absent: 0).
        num_prompt_tokens: the prompt's length in tokens.

    Raises:
        ValueError: a store hit that is negative or longer than the prompt.
    """
    cands = list(candidates)
    hits = [store_hits.get(c.position, 0) for c in cands]
    if any(not 0 <= s <= num_prompt_tokens for s in hits):
        raise ValueError(f"store hits {hits} outside [0, {num_prompt_tokens}]")
    scored = [Candidate(c.position, max(0, c.hit_tokens - s), c.load)
              for c, s in zip(cands, hits)]
    return scored, num_prompt_tokens - min(hits, default=0)


def choose_with_store(policy, candidates: list[Candidate], store_hits: Mapping[int, int],
                      num_prompt_tokens: int) -> Decision:
    """The policy's pick on advantages over the store (``discount_store_hits``). When it
    falls back to load (the store holds as much as any engine), the least-loaded engine that
    holds the most itself is taken among equally loaded ones (its prefix needs no store load).
    ``hit_tokens`` of the decision is the engine's own (local) hit.

    Raises:
        ValueError: no candidate, or a store hit outside ``[0, num_prompt_tokens]``.
    """
    by_pos = {c.position: c for c in candidates}
    scored, remainder = discount_store_hits(candidates, store_hits, num_prompt_tokens)
    d = policy.choose(scored, remainder)
    if d.reason == LOAD:
        low = by_pos[d.position].load
        best = max((c for c in candidates if c.load == low),
                   key=lambda c: (c.hit_tokens, c.position == d.position))
        if best.hit_tokens > by_pos[d.position].hit_tokens:
            d = Decision(best.position, LOAD, best.hit_tokens)
    return dataclasses.replace(d, hit_tokens=by_pos[d.position].hit_tokens)


def store_can_change_pick(policy, candidates: list[Candidate], num_prompt_tokens: int,
                          chunk_size: int | None = None) -> bool:
    """Whether the store's hits could change ``choose_with_store``'s pick when every candidate
    saves to one namespace (one store hit ``s`` for all): not when no engine wins on its own
    hits (the module's argument), nor when an engine that wins on hits is among the least
    loaded: with the store it either still wins (advantages shrink by the same ``s``, so the
    same engines lead) or the pick falls back to the least loaded, among whom it holds the
    most. With ``chunk_size`` (the namespace's), not either when the same engines win on hits
    with the most the store can hold, ``s_max`` = the prompt's full chunks: the lookup
    answers whole chunks of the prompt, so ``0 <= s <= s_max``, and the winners at ``s = 0``
    and at ``s_max`` win at every ``s`` between (module docstring). Changes nothing."""
    winners = policy.hit_winners(candidates, num_prompt_tokens)
    if not winners:
        return False
    low = min(c.load for c in candidates)
    if not all(c.load > low for c in winners):
        return False
    if chunk_size is None:
        return True
    s_max = num_prompt_tokens // chunk_size * chunk_size
    scored, remainder = discount_store_hits(
        candidates, {c.position: s_max for c in candidates}, num_prompt_tokens)
    at_most = policy.hit_winners(scored, remainder)
    return {c.position for c in at_most} != {c.position for c in winners}


class StoreLookup:
    """Asks a kvstore daemon how many of a prompt's leading tokens it holds.

    Args:
        url: the daemon's base URL (``http://host:port``).
        timeout_s: deadline of one request's lookups (all namespaces together), > 0.
        auth_token: bearer token of a daemon started with ``--auth-token`` (None: none).

    Raises:
        ValueError: a URL that is not ``http(s)://host[:port]`` or a deadline <= 0.
    """

    def __init__(self, url: str, timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
                 auth_token: str | None = None):
        from connectors.prompt_keys import LOOKUP_HEADERS, lookup_body
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--kvstore-url: expected http://host:port, got {url!r}")
        if not timeout_s > 0:
            raise ValueError(f"the store lookup deadline must be > 0 s, got {timeout_s}")
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": "application/json", **LOOKUP_HEADERS}
        if auth_token:
            self.headers["Authorization"] = f"Bearer {auth_token}"
        self._lookup_body = lookup_body
        self._conns: LookupConnections | None = None
        self.url = url.rstrip("/")
        #: ``(seconds until the answer is in, seconds parsing it)`` of the last lookup on
        #: those connections (``bench/router_lookup.py``), or None
        self.last_timing: tuple[float, float] | None = None
        #: whether the daemon answered its last probe or lookup (None: not asked yet)
        self.answering: bool | None = None
        self._warned_at: float | None = None   # monotonic time of the last "down" warning
        self._down_logged = False                # that warning was logged for this outage

    @property
    def url(self) -> str:
        """The daemon's base URL; setting it closes the lookup connections to the old one."""
        return self._url

    @url.setter
    def url(self, url: str) -> None:
        self.close()
        self._url = url
        #: the lookups' own kept-alive connections (``engine_min.router.lookup_conn``); an
        #: https daemon is asked through the router's ``aiohttp`` session
        self._conns = LookupConnections(url, self.headers) if url.startswith("http://") \
            else None

    #: seconds between ``watch``'s probes, and at least between two "down" warnings
    probe_interval_s = 5.0
    warn_interval_s = 30.0

    def _mark(self, ok: bool, why: str = "") -> None:
        """Record whether the daemon answered; log a change (module docstring)."""
        was, self.answering = self.answering, ok
        if ok:
            if was is None:
                logger.info("shared store %s answers", self.url)
            elif was is False and self._down_logged:
                logger.info("shared store %s answers again; store lookups resume", self.url)
            self._down_logged = False
            return
        if self._down_logged:
            return
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < self.warn_interval_s:
            return   # flapping: logged by a later probe once the interval passed, if still down
        self._warned_at, self._down_logged = now, True
        logger.warning("shared store %s is not usable (%s): requests are routed on the "
                       "engines' own hits until it answers", self.url, why)

    def _refused(self, status: int) -> str:
        return (f"GET /v1/whoami: HTTP {status}: "
                + ("wrong token" if "Authorization" in self.headers else "no token given"))

    def check_token(self, timeout_s: float = 2.0) -> str | None:
        """Ask the daemon's ``GET /v1/whoami`` with the router's token, blocking (at start).
        Returns why the daemon refuses the token (HTTP 401 or 403), else None: accepted, or
        not answering (``watch`` reports that)."""
        import urllib.error
        import urllib.request
        req = urllib.request.Request(self.url + "/v1/whoami", headers={
            k: v for k, v in self.headers.items() if k == "Authorization"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s):
                return None
        except urllib.error.HTTPError as err:
            return self._refused(err.code) if err.code in (401, 403) else None
        except (urllib.error.URLError, OSError, ValueError):
            return None

    async def probe(self, session: aiohttp.ClientSession, timeout_s: float = 2.0) -> bool:
        """Ask the daemon's ``GET /v1/whoami`` with the router's token (at most
        ``timeout_s``); record and log the answer (``answering``). True when it answered
        200."""
        try:
            async with asyncio.timeout(timeout_s):
                async with session.get(self.url + "/v1/whoami", headers=self.headers) as r:
                    ok, why = r.status == 200, (self._refused(r.status) if r.status in
                                                (401, 403) else f"GET /v1/whoami: HTTP {r.status}")
        except TimeoutError:
            ok, why = False, f"GET /v1/whoami: no answer within {timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            ok, why = False, f"GET /v1/whoami: {exc}"
        self._mark(ok, why)
        return ok

    async def watch(self, session: aiohttp.ClientSession) -> None:
        """Probe at once, then every ``probe_interval_s`` until cancelled."""
        while True:
            await self.probe(session)
            await asyncio.sleep(self.probe_interval_s)

    @staticmethod
    def askable(namespaces: Iterable, num_tokens: int) -> list:
        """The namespaces of ``namespaces`` (one each) a prompt of ``num_tokens`` tokens has
        a full chunk in: those ``lookup_bodies`` makes a body for."""
        out, seen = [], set()
        for ns in namespaces:
            if ns.ns_id not in seen and num_tokens >= ns.layout.chunk_size:
                seen.add(ns.ns_id)
                out.append(ns)
        return out

    def lookup_bodies(self, namespaces: Iterable, token_ids) -> dict[bytes, bytes]:
        """The ``/v1/lookup`` body of ``token_ids``'s (a list, or a uint32 array: cheaper)
        full chunks per namespace (keyed by ``ns_id``) of ``askable``. CPU-bound (sha256
        over the prompt: about 0.05 ms for 2k tokens given as an array).

        Raises:
            ValueError: a token id that is not an integer in ``[0, 2**32)``.
        """
        return {ns.ns_id: self._lookup_body(ns, token_ids)
                for ns in self.askable(namespaces, len(token_ids))}

    async def hit_tokens(self, session: aiohttp.ClientSession, bodies: Mapping[bytes, bytes],
                         metrics: RouterMetrics) -> dict[bytes, int]:
        """Store hit tokens per ``ns_id`` of ``bodies`` (``lookup_bodies``); ``{}`` when the
        deadline passed or the daemon failed (counted in ``metrics.store_lookups``, logged
        at debug; a failure also marks the daemon down, ``_mark``)."""
        if not bodies:
            return {}
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                if len(bodies) == 1:   # sent at once, in this step of the event loop
                    found = [await self._one(session, next(iter(bodies.values())))]
                else:
                    found = await asyncio.gather(*(self._one(session, b)
                                                   for b in bodies.values()))
        except TimeoutError:
            metrics.store_lookup_time.observe(time.perf_counter() - t0)
            metrics.store_lookups.labels("timeout").inc()
            logger.debug("store lookup past its %.1f ms deadline", self.timeout_s * 1e3)
            return {}
        except (aiohttp.ClientError, OSError, ValueError, KeyError, TypeError) as exc:
            metrics.store_lookup_time.observe(time.perf_counter() - t0)
            metrics.store_lookups.labels("error").inc()
            logger.debug("store lookup failed after %.1f ms: %r",
                         (time.perf_counter() - t0) * 1e3, exc)
            self._mark(False, f"lookup: {exc!r}")
            return {}
        metrics.store_lookup_time.observe(time.perf_counter() - t0)
        metrics.store_lookups.labels("ok").inc()
        self._mark(True)
        return dict(zip(bodies, found))

    async def _one(self, session: aiohttp.ClientSession, body: bytes) -> int:
        if self._conns is not None:
            t0 = time.perf_counter()
            status, raw = await self._conns.post("/v1/lookup", body)
            t1 = time.perf_counter()
            try:
                answer = json.loads(raw)
            except ValueError:
                raise ValueError(f"/v1/lookup: HTTP {status}: not JSON: {raw[:200]!r}") from None
            self.last_timing = (t1 - t0, time.perf_counter() - t1)
            if status != 200:
                raise ValueError(f"/v1/lookup: HTTP {status}: {answer}")
        else:
            async with session.post(self.url + "/v1/lookup", data=body,
                                    headers=self.headers) as r:
                answer = await r.json(content_type=None)
                if r.status != 200:
                    raise ValueError(f"/v1/lookup: HTTP {r.status}: {answer}")
        return int(answer["num_hit_chunks"]) * int(answer["chunk_size"])

    def close(self) -> None:
        """Close the lookup connections kept open (the router's ``stop``)."""
        if self._conns is not None:
            self._conns.close()
