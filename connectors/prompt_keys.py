"""A prompt's chunk keys in an engine's store namespace, for a router that asks the engines'
shared kvstore daemon how much of a prompt it holds (``engine_min.router.store_lookup``).

The namespace is the one the engine's connector saves under, as it reports it
(``get_stats()["store_namespace"]``, ``Namespace.to_dict``, served in the engine's
``/debug/stats``); the keys are ``Namespace.chunk_keys`` of the prompt's token ids, the same
keys the connector saves and looks up; the body is the daemon's ``POST /v1/lookup`` request
(``kvstore.daemon.protocol.key_request``). A router reaches the store's key scheme only through
here, as an engine reaches the store only through its connector.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from kvstore.daemon import protocol as P
from kvstore.keys import Namespace

#: headers of a ``/v1/lookup`` request besides ``Content-Type`` and authorization
LOOKUP_HEADERS = {P.VERSION_HEADER: str(P.PROTOCOL_VERSION)}


def parse_namespace(d: dict) -> Namespace:
    """The ``Namespace`` of an engine's reported ``store_namespace``.

    Raises:
        KeyError, ValueError, TypeError: a malformed namespace.
    """
    return Namespace.from_dict(d)


def lookup_body(ns: Namespace, token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The ``/v1/lookup`` JSON body of the full chunks of ``token_ids`` in ``ns``. A list is
    made a uint32 array first (through ``array``: about a third of the time ``numpy``
    takes to convert a list, the bulk of the cost of 2k tokens' keys).

    Raises:
        ValueError: a token id that is not an integer in ``[0, 2**32)``.
    """
    if isinstance(token_ids, list):
        try:
            token_ids = np.frombuffer(array("I", token_ids), dtype=np.uint32)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    return P.key_request(ns, ns.chunk_keys(token_ids))
