"""The vLLM connector's options, read once from ``kv_connector_extra_config`` (keys in
``connectors.vllm``'s docstring). Importable without vLLM.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from connectors.stores import StoreSpec
from kvstore.defaults import DEFAULT_CHUNK_SIZE

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
    """

    chunk_size: int
    tail_chunk_size: int
    timeout_s: float
    pin_lease_s: float
    save_queue_bytes: int
    store: StoreSpec

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], block_size: int) -> "ConnectorOptions":
        """Read ``kv_connector_extra_config``; ``block_size`` is vLLM's (tokens per block),
        the default tail piece size when it divides ``chunk_size``.

        Raises:
            ValueError: a ``tail_chunk_size`` that does not divide ``chunk_size`` or is not
                smaller; a bad number.
        """
        chunk_size = int(extra.get("chunk_size", DEFAULT_CHUNK_SIZE))
        tail = extra.get("tail_chunk_size")
        if tail is None:
            tail = block_size if block_size < chunk_size and chunk_size % block_size == 0 else 0
        tail = int(tail)
        if tail and (tail < 0 or tail >= chunk_size or chunk_size % tail):
            raise ValueError(f"tail_chunk_size {tail} must divide chunk_size {chunk_size} "
                             f"and be smaller (0 disables tail pieces)")
        if "save_queue" in extra:
            log.warning("kv_connector_extra_config 'save_queue' (a count of saves) is replaced "
                        "by 'save_queue_bytes'; ignored")
        timeout_s = float(extra.get("timeout_s", 2.0))
        return cls(chunk_size=chunk_size, tail_chunk_size=tail, timeout_s=timeout_s,
                   pin_lease_s=float(extra.get("pin_lease_s", 30.0)),
                   save_queue_bytes=int(extra.get("save_queue_bytes",
                                                  DEFAULT_SAVE_QUEUE_BYTES)),
                   store=store_spec(extra, timeout_s))


def store_spec(extra: Mapping[str, Any], timeout_s: float) -> StoreSpec:
    """The store ``extra`` names: the daemon at ``kvstore_url`` (the bare client, calls with
    ``timeout_s``), else in-process tiers (``cpu_bytes`` default ``"1GiB"``, ``disk_bytes``,
    ``disk_path``; ``store_name`` tells apart equal ones)."""
    if extra.get("kvstore_url"):
        return StoreSpec(url=str(extra["kvstore_url"]), auth_token=extra.get("auth_token"),
                         timeout_s=timeout_s)
    return StoreSpec(cpu_bytes=str(extra.get("cpu_bytes", "1GiB")),
                     disk_bytes=extra.get("disk_bytes") or None, disk_path=extra.get("disk_path"),
                     name=str(extra.get("store_name", "default")))
