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

from collections.abc import Sequence

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


def lookup_body(ns: Namespace, token_ids: Sequence[int]) -> bytes:
    """The ``/v1/lookup`` JSON body of the full chunks of ``token_ids`` in ``ns``."""
    return P.key_request(ns, ns.chunk_keys(token_ids))
