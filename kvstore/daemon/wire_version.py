"""Version of the kvstore daemon's wire format and the header that carries it.

Kept apart from ``kvstore.daemon.fields`` (which re-exports these) so that the HTTP transport
(``kvstore.daemon.transport``) and the ``kvstore stats``/``clear`` commands import neither the
key types nor torch.
"""
from __future__ import annotations

#: the version this code speaks (requests and answers carry it in ``VERSION_HEADER``)
PROTOCOL_VERSION = 1
#: versions a daemon accepts in a request's ``VERSION_HEADER``
SUPPORTED_VERSIONS = (1,)
#: HTTP header of every request and answer: ``X-KVStore-Protocol: 1``
VERSION_HEADER = "X-KVStore-Protocol"
