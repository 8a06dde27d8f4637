"""The vLLM connector's options, read once from ``kv_connector_extra_config`` (keys in
``connectors.vllm``'s docstring). Importable without vLLM.
"""
from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

from connectors.chunk_geometry import ChunkGeometry
from connectors.stores import BreakerTimes, StoreSpec
from kvstore.defaults import DEFAULT_CHUNK_SIZE
from kvstore.units import parse_size

log = logging.getLogger("kvstore.connectors.vllm")

#: Default bytes of gathered chunks waiting for the background writer.
DEFAULT_SAVE_QUEUE_BYTES = 512 << 20


@dataclass(frozen=True)
class ConnectorOptions:
    """Options of one ``KVStoreConnector``.

    Attributes:
        chunk_size: tokens per stored chunk.
        tail_chunk_size: tokens per tail piece (divides ``chunk_size``); 0 = off.
        timeout_s: deadline of each store call made before or during a forward pass (s).
        pin_lease_s: how long chunks found by a lookup stay pinned (s); 0 = no pins.
        save_queue_bytes: bytes of gathered chunks the background writer may hold.
        store: the store to open (shared by the connectors of one process).
        layerwise_load: loads run layer by layer beside the forward pass (layer ``i``'s
            attention waits only for layer ``i``); False: whole loads before it; None
            (``"auto"``, the default): layer by layer when the KV caches are on a GPU, whole
            on CPU (where the load's copies and the forward pass share the same cores, and
            whole loads measured faster: ``bench.vllm_compare``).
    """

    chunk_size: int
    tail_chunk_size: int
    timeout_s: float
    pin_lease_s: float
    save_queue_bytes: int
    store: StoreSpec
    layerwise_load: bool | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], block_size: int) -> "ConnectorOptions":
        """Read ``kv_connector_extra_config``; ``block_size`` is vLLM's (tokens per block),
        the default tail piece size when it divides ``chunk_size``. Every value is checked
        here, before any store opens.

        Raises:
            ValueError: a value of the wrong type or range, naming its key: ``chunk_size`` not
                a positive integer multiple of ``block_size``; a ``tail_chunk_size`` that is
                negative, does not divide ``chunk_size``, is not smaller or not a multiple of
                ``block_size``; ``timeout_s`` not a positive number; ``pin_lease_s`` negative;
                ``save_queue_bytes`` not a byte size (``512MiB`` or an int); ``layerwise_load``
                not a boolean (``true``/``false``, 1/0) or ``auto``; a bad remote tier setting
                (``remote_fields``); a key that is not one of ``KNOWN_KEYS`` (a close match
                suggested); ``auth_token`` without ``kvstore_url``; ``cpu_bytes`` or
                ``disk_bytes`` not a byte size; ``kvstore_url``, ``auth_token``,
                ``disk_path``, ``store_name``, ``model_id``, ``revision``, ``hash_algo`` or
                ``weights_fingerprint`` not text.
        """
        check_keys(extra)
        chunk_size = _int(extra, "chunk_size", DEFAULT_CHUNK_SIZE, minimum=1)
        tail = extra.get("tail_chunk_size")
        if tail is None:
            tail = block_size if block_size < chunk_size and chunk_size % block_size == 0 else 0
        else:
            tail = _int(extra, "tail_chunk_size", 0, minimum=0)
        if tail and (tail >= chunk_size or chunk_size % tail):
            raise ValueError(f"tail_chunk_size {tail} must divide chunk_size {chunk_size} "
                             f"and be smaller (0 disables tail pieces)")
        ChunkGeometry(block_size, chunk_size, tail)   # multiples of vLLM's block size
        if "save_queue" in extra:
            log.warning("kv_connector_extra_config 'save_queue' (a count of saves) is replaced "
                        "by 'save_queue_bytes'; ignored")
        timeout_s = _seconds(extra, "timeout_s", 2.0, allow_zero=False)
        try:
            queue_bytes = parse_size(extra.get("save_queue_bytes", DEFAULT_SAVE_QUEUE_BYTES))
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config 'save_queue_bytes': {e}") from None
        return cls(chunk_size=chunk_size, tail_chunk_size=tail, timeout_s=timeout_s,
                   pin_lease_s=_seconds(extra, "pin_lease_s", 30.0, allow_zero=True),
                   save_queue_bytes=queue_bytes, store=store_spec(extra, timeout_s),
                   layerwise_load=_auto_bool(extra, "layerwise_load"))


def _auto_bool(extra: Mapping[str, Any], key: str) -> bool | None:
    """``extra[key]`` as ``_bool`` does, or None when absent, None or ``"auto"``."""
    value = extra.get(key)
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return _bool(extra, key, False)


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    """``extra[key]`` (default ``default``) as a bool: a bool, 0/1, or the text
    ``true``/``false``/``1``/``0``/``yes``/``no``/``on``/``off`` (any case).

    Raises:
        ValueError: naming ``key`` and the value.
    """
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"kv_connector_extra_config {key!r} must be true or false, got {value!r}")


def _int(extra: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    """``extra[key]`` (default ``default``) as an int ``>= minimum``: an int or a string of
    one (``"256"``); a bool, a fraction (``2.7``) or other text is refused, not truncated.

    Raises:
        ValueError: naming ``key`` and the value.
    """
    value = extra.get(key, default)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"kv_connector_extra_config {key!r} must be an integer >= {minimum}, "
                         f"got {value!r}")
    return value


def _seconds(extra: Mapping[str, Any], key: str, default: float, allow_zero: bool) -> float:
    """``extra[key]`` (default ``default``) as a finite number of seconds, ``> 0`` (or
    ``>= 0`` with ``allow_zero``).

    Raises:
        ValueError: naming ``key`` and the value (text, NaN, infinity, out of range).
    """
    value = extra.get(key, default)
    try:
        seconds = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"kv_connector_extra_config {key!r} must be a number of seconds "
                         f"{bound}, got {value!r}")
    return seconds


#: ``kv_connector_extra_config`` keys of the in-process store's remote tier (Redis).
REMOTE_KEYS = ("remote_url", "remote_key_prefix", "remote_ttl_s", "remote_timeout_s")
#: Keys only a ``kvstore serve`` daemon reads: refused without ``kvstore_url``.
DAEMON_KEYS = ("auth_token",)
#: Keys whose value must be text (a string) when given.
TEXT_KEYS = ("kvstore_url", "auth_token", "disk_path", "store_name", "model_id", "revision",
             "hash_algo", "weights_fingerprint")
#: Every ``kv_connector_extra_config`` key the connector reads (``connectors.vllm``'s
#: docstring); ``save_queue`` is the old name of ``save_queue_bytes`` (ignored, warned).
KNOWN_KEYS = frozenset(("kvstore_url", "auth_token", "cpu_bytes", "disk_bytes", "disk_path",
                        "store_name", *REMOTE_KEYS, "model_id", "revision",
                        "weights_fingerprint", "hash_algo", "chunk_size", "tail_chunk_size",
                        "timeout_s", "save_queue_bytes", "save_queue", "pin_lease_s",
                        "layerwise_load"))


def check_keys(extra: Mapping[str, Any]) -> None:
    """Refuse keys the connector would not read and values of the wrong kind, before any
    value is used: a misspelt key (``kvstore_ulr``) would otherwise fall back to a default
    silently.

    Raises:
        ValueError: a key not in ``KNOWN_KEYS`` (naming it, the closest known key when one
            is close, and the known keys); a ``DAEMON_KEYS`` key without ``kvstore_url``; a
            ``TEXT_KEYS`` value that is not a string (``weights_fingerprint``: ``"auto"``,
            ``"off"`` or a fingerprint); ``cpu_bytes`` / ``disk_bytes`` not a byte size
            (``"cpu_bytes: not a byte size: 'lots'"``).
    """
    for key in extra:
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(str(key), sorted(KNOWN_KEYS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"kv_connector_extra_config: unknown key {key!r}{hint}; known "
                             f"keys: {', '.join(sorted(KNOWN_KEYS))}")
    if not extra.get("kvstore_url"):
        given = [k for k in DAEMON_KEYS if extra.get(k) not in (None, "")]
        if given:
            raise ValueError(f"kv_connector_extra_config {', '.join(map(repr, given))} needs "
                             f"'kvstore_url' (only a kvstore daemon reads it)")
    for key in TEXT_KEYS:
        value = extra.get(key)
        if value is not None and not isinstance(value, str):
            what = ("'auto', 'off' or a fingerprint string" if key == "weights_fingerprint"
                    else "text")
            raise ValueError(f"kv_connector_extra_config {key!r} must be {what}, got {value!r}")
    for key in ("cpu_bytes", "disk_bytes"):
        if extra.get(key) not in (None, ""):
            try:
                parse_size(extra[key])
            except (TypeError, ValueError) as e:
                raise ValueError(f"{key}: {e}") from None


def remote_fields(extra: Mapping[str, Any]) -> dict:
    """The remote tier's ``StoreSpec`` fields ``extra`` gives (``{}``: none): ``remote_url``
    (``redis://host:port[,host:port...]``, ``rediss://``; password in it or in
    ``$KVSTORE_REMOTE_PASSWORD``), ``remote_key_prefix``, ``remote_ttl_s`` (>= 0),
    ``remote_timeout_s`` (> 0). Checked without connecting to Redis.

    Raises:
        ValueError: naming the key: a remote key without ``remote_url``, a URL that does not
            parse (the message never holds the password), a prefix that is not text, a bad
            number of seconds; ``remote_url`` together with ``kvstore_url`` (the remote tier
            belongs to the daemon then: ``kvstore serve --remote-url``).
    """
    given = [k for k in REMOTE_KEYS if extra.get(k) not in (None, "")]
    if not given:
        return {}
    if "remote_url" not in given:
        raise ValueError(f"kv_connector_extra_config {', '.join(map(repr, given))} needs "
                         f"'remote_url'")
    if extra.get("kvstore_url"):
        raise ValueError("kv_connector_extra_config 'remote_url' is a tier of the in-process "
                         "store, but 'kvstore_url' names a daemon: start the daemon with "
                         "kvstore serve --remote-url instead")
    from kvstore.tiers.redis_url import parse_redis_url
    url = extra["remote_url"]
    try:
        parse_redis_url(url, env={})
    except ValueError as e:
        raise ValueError(f"kv_connector_extra_config 'remote_url': {e}") from None
    out: dict[str, Any] = {"remote_url": url}
    if "remote_key_prefix" in given:
        if not isinstance(extra["remote_key_prefix"], str):
            raise ValueError(f"kv_connector_extra_config 'remote_key_prefix' must be text, "
                             f"got {extra['remote_key_prefix']!r}")
        out["remote_key_prefix"] = extra["remote_key_prefix"]
    if "remote_ttl_s" in given:
        out["remote_ttl_s"] = _seconds(extra, "remote_ttl_s", 0.0, allow_zero=True)
    if "remote_timeout_s" in given:
        out["remote_timeout_s"] = _seconds(extra, "remote_timeout_s", 0.25, allow_zero=False)
    return out


def store_spec(extra: Mapping[str, Any], timeout_s: float) -> StoreSpec:
    """The store ``extra`` names: the daemon at ``kvstore_url`` (its client behind a breaker,
    as engine_min's), else in-process tiers (``cpu_bytes`` default ``"1GiB"``, ``disk_bytes``,
    ``disk_path``; ``store_name`` tells apart equal ones) with a remote tier in Redis when
    ``remote_url`` is given (``remote_fields``). With ``kvstore_url`` the in-process keys are
    not used (logged as a warning when given).

    Raises:
        ValueError: as ``remote_fields``.
    """
    remote = remote_fields(extra)
    if extra.get("kvstore_url"):
        local = [k for k in ("cpu_bytes", "disk_bytes", "disk_path") if extra.get(k)]
        if local:
            log.warning("kv_connector_extra_config: %s ignored: with 'kvstore_url' the vLLM "
                        "connector uses the daemon alone", ", ".join(map(repr, local)))
        return StoreSpec(url=str(extra["kvstore_url"]), auth_token=extra.get("auth_token"),
                         timeout_s=timeout_s, breaker=BreakerTimes.for_connector(timeout_s))
    return StoreSpec(cpu_bytes=str(extra.get("cpu_bytes", "1GiB")),
                     disk_bytes=extra.get("disk_bytes") or None, disk_path=extra.get("disk_path"),
                     name=str(extra.get("store_name", "default")), **remote)


#: vLLM executors (``parallel_config.distributed_executor_backend``) whose worker runs in the
#: scheduler's process, so an in-process store is one store for both sides.
SAME_PROCESS_EXECUTORS = ("uni", "external_launcher")


def executor_name(backend: Any) -> str:
    """vLLM's ``distributed_executor_backend`` as text: the name given (``"mp"``, ``"ray"``,
    ``"uni"``...), ``"uni"`` for a class derived from vLLM's ``UniProcExecutor``, else the
    class's name."""
    if isinstance(backend, type):
        names = [c.__name__ for c in backend.__mro__]
        return "uni" if "UniProcExecutor" in names else backend.__name__
    return str(backend)


def check_store_reach(spec: StoreSpec, backend: Any) -> None:
    """Refuse an in-process store (no ``kvstore_url``) that the scheduler-side connector could
    never read: vLLM builds the scheduler-side connector in the scheduler's process and the
    worker-side one in each worker's; with an executor whose workers are other processes
    (``"mp"``, ``"ray"``) each side would open a store of its own, the worker filling one the
    scheduler never looks up. A remote tier (``remote_url``) is shared through Redis, so it is
    let through (hits then come from Redis only: logged as a warning).

    Args:
        spec: the store the options name.
        backend: ``vllm_config.parallel_config.distributed_executor_backend`` after vLLM's
            platform has updated it (a name or an executor class).

    Raises:
        ValueError: an in-process store without a remote tier under such an executor, saying
            what to do instead.
    """
    name = executor_name(backend)
    if spec.url or name in SAME_PROCESS_EXECUTORS:
        return
    if spec.remote_url:
        log.warning("vLLM executor %r runs the workers in other processes than the scheduler: "
                    "the in-process tiers are not shared, lookups hit in the remote tier only "
                    "(a daemon, 'kvstore_url', shares all tiers)", name)
        return
    raise ValueError(
        f"kv_connector_extra_config has no 'kvstore_url', so the store is in-process, but "
        f"vLLM's executor {name!r} runs the worker in another process than the scheduler: "
        f"the worker would fill a store the scheduler never reads and no request would ever "
        f"hit. Either run a kvstore daemon (kvstore serve) and set 'kvstore_url', or keep "
        f"the worker in the scheduler's process: one worker (no tensor or pipeline "
        f"parallelism), distributed_executor_backend='uni' (vLLM's default then), and on "
        f"vLLM's CPU platform also the environment variable VLLM_ENABLE_V1_MULTIPROCESSING=0 "
        f"(without it the CPU platform turns 'uni' into 'mp')")
