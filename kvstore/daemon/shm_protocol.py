"""Wire format of the daemon's same-host path: a Unix domain socket for control, the CPU arena
in shared memory for data. Pure framing helpers (blocking and asyncio), no store logic.

Why: an engine on the daemon's host should load at memory speed. Over this path a get moves
no chunk bytes through a socket: the daemon pins the chunks and answers with where their bytes
lie in the arena (page runs); the client, which mapped the arena read-only once, copies them
straight into its destination and then releases the pins.

Frames (both directions) reuse the binary message of ``kvstore.daemon.protocol``::

    b"KVS\\x01" | uint32 LE header length | JSON header | payload (header["payload_bytes"] bytes)

Every request header has ``"op"``; keys travel as hex of ``bytes(ChunkKey)``, namespaces as
``Namespace.to_dict()``, exactly as over HTTP (``kvstore.daemon.fields``). A request with
``keys`` (lookup, exists, get, remove, demote, pin, unpin) may give them instead in compact
form, ``hashes``: one hex string of the keys' prefix hashes back to back (every key of a
request is of its namespace, so its id is not repeated; ``hashes_frame``, ``parse_hashes``).
``ShmKVStoreClient`` sends every key request but ``pin`` so. Every reply has
``"ok": true`` and the op's fields, or ``"ok": false, "status": int, "error": str`` (the HTTP
status the same failure gets over HTTP: 400 bad input, 401 bad token, 403 another tenant's
namespace or a reader's write, 404 unknown op, 413 too many keys, 429 a get while the
connection holds 1024 borrows unreleased, 503 shutting down, 504 a request, a payload or a
frame begun not sent, or a reply not read, within the request timeout: the connection ends).

Requests and replies, in order on one connection (a client may send requests before reading
earlier replies; they are served and answered in order; ``release`` has no reply):

=========  =====================================================  ==================================
op         request fields                                         reply fields
=========  =====================================================  ==================================
hello      ``version`` (3, 2 or 1), ``token`` (str/null);         ``version``, ``instance`` (the
           version 3: optional ``vm_probe``                       daemon's id, as in ``/v1/stats``),
           ({address, hex}: ``kvstore.daemon.shm_vm``)            ``arena_bytes``, ``page_bytes``,
                                                                  ``tenant`` ({name, role, salt});
                                                                  version 3: ``vm_read`` (bool);
                                                                  the arena's file descriptor rides
                                                                  on this reply (``SCM_RIGHTS``)
                                                                  when ``arena_bytes`` > 0
lookup     ``namespace``, ``keys``                                as ``/v1/lookup``
exists     ``namespace``, ``keys``                                ``exists`` [bool]
get        ``namespace``, ``keys``                                ``borrow`` (int or null),
                                                                  ``chunks``: per key null (miss),
                                                                  ``{"runs": [[offset, nbytes], ...]}``
                                                                  (bytes in the arena, in order) or
                                                                  ``{"inline": nbytes}`` (bytes in
                                                                  this reply's payload, in key
                                                                  order: chunks of lower tiers)
release    ``borrow``                                             (none: no reply)
put        the put header of ``kvstore.daemon.protocol``          as ``POST /v1/put``: ``stored``,
           (``namespace``, ``chunks`` with ``xxh3``, ...),        ``num_chunks``, ``durable``,
                                                                  ``already_stored``, ``refused``,
                                                                  ``first_refused``
           payload = the chunks' bytes in order; or
           ``staging_offset`` (below); or version 3:
           ``vm`` [[address, nbytes], ...] and ``pid``
remove     ``namespace``, ``keys``                                ``removed``
demote     ``namespace``, ``keys``                                ``demoted``
clear      ``namespace`` (or null: admin only)                    ``removed``
pin        ``namespace``, ``keys``, ``lease_s`` (or null)         ``pinned``
unpin      ``namespace``, ``keys``                                ``unpinned``
stats      (none)                                                 as ``/v1/stats``
stage      ``nbytes``; payload = 1 byte carrying the client's     ``staging_bytes``
           staging memfd (``SCM_RIGHTS``;
           ``kvstore.daemon.shm_staging``)
=========  =====================================================  ==================================

A put may instead take its chunks' bytes from the connection's staging area: the put header
plus ``staging_offset`` (the first chunk's byte offset in the staging area; the chunks lie
back to back from there) and no payload. The daemon copies each chunk into reserved arena
pages and hashes the copy, so the client must not rewrite those bytes before the put's reply
(it may send the next request first: replies come in request order, one per request).
From version 2 on, the entries of a put from staging may leave out ``xxh3``: the daemon then
copies those chunks without hashing them. Nothing crosses a socket there (the bytes are the
client's own memory, copied once by the daemon), so a checksum would only compare the daemon's
copy with the client's intent; a client that rewrites its staging bytes before the reply can
store only what it could have put anyway (into its own namespaces), and the store keeps no
checksum of a put (its disk and remote tiers checksum the stored bytes when they write
them). A put whose bytes follow on the socket still carries ``xxh3`` for every entry.

From version 3 on, a client whose ``hello`` carried a ``vm_probe`` that the daemon read back
(``vm_read: true``) may put chunks without copying them anywhere: ``vm`` names each chunk's
bytes in the client's own memory and the daemon reads them into reserved arena pages with
``process_vm_readv``, from the process that connected only (``kvstore.daemon.shm_vm`` gives the
rules; entries may leave out ``xxh3`` as from staging).

Pins of a get (``borrow``) belong to the connection: ``release`` drops them, and so does the
connection's end (a client that dies releases everything it held). A pinned chunk's pages are
never reused, even if it is removed or evicted meanwhile, so the bytes a client copies are the
chunk's until it releases them.

Security: the socket file is mode 0600; the daemon accepts only peers of its own uid or root
(``SO_PEERCRED``) and checks the token in ``hello`` as HTTP checks the bearer token. The arena is
an anonymous memory file (``memfd``) reachable only through the descriptor passed on an
accepted connection; a client maps it read-only (``PROT_READ``), so it cannot write a page.
"""
from __future__ import annotations

import array
import asyncio
import json
import socket
import struct
from itertools import repeat
from operator import eq
from typing import Any, Sequence

from kvstore.daemon.protocol import (MAGIC, MAX_HEADER_BYTES, PREAMBLE, PREAMBLE_BYTES,
                                     PREFIX_HASH_BYTES, ProtocolError, check_key_types,
                                     decode_preamble)
from kvstore.keys import ChunkKey, Namespace, trusted_keys

#: Version of this path's messages a client sends in ``hello`` (the daemon answers it back).
#: 2: a put from staging may leave out its entries' ``xxh3`` (module docstring).
#: 3: ``hello``'s ``vm_probe`` and a put's ``vm`` ranges (``kvstore.daemon.shm_vm``).
SHM_VERSION = 3
#: Versions the daemon serves.
SHM_VERSIONS = (1, 2, 3)
#: ops with a reply (``release`` has none)
OPS = ("hello", "lookup", "exists", "get", "release", "put", "remove", "demote", "clear", "pin",
       "unpin", "stats", "stage")
#: ``struct ucred`` of ``SO_PEERCRED``: pid, uid, gid
_UCRED = struct.Struct("3i")


def encode_frame(header: dict, payload_bytes: int = 0) -> bytes:
    """Preamble + JSON header of one frame (``payload_bytes`` recorded in the header when > 0;
    the caller sends that many payload bytes right after).

    Raises:
        ProtocolError: a header larger than ``MAX_HEADER_BYTES``.
    """
    if payload_bytes:
        header = {**header, "payload_bytes": payload_bytes}
    blob = _encode_json(header).encode()  # (encode_preamble_and_header's form, one encoder)
    if len(blob) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(blob)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREAMBLE.pack(MAGIC, len(blob)) + blob


def decode_header(blob: bytes) -> tuple[dict, int]:
    """``(header, payload bytes)`` from a frame's JSON header.

    Raises:
        ProtocolError: not a JSON object (or one nested too deeply to decode), or a bad
            ``payload_bytes``.
    """
    try:
        try:  # UTF-8 (every client's): the decoder without json.loads' encoding detection
            header = _decode_json(blob.decode())
        except ValueError:  # (UnicodeDecodeError too) another encoding, a BOM, or not JSON
            header = json.loads(blob)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"frame header is not JSON: {e}") from None
    except RecursionError:  # arrays/objects nested thousands deep: the decoder recurses
        raise ProtocolError("frame header is nested too deeply") from None
    if not isinstance(header, dict):
        raise ProtocolError("frame header must be a JSON object")
    n = header.get("payload_bytes", 0)
    if type(n) is not int or n < 0:
        raise ProtocolError(f"payload_bytes must be an int >= 0, got {n!r}")
    return header, n


_KEY_TYPE = {ChunkKey}
_NS_ID, _PREFIX_HASH = ChunkKey.ns_id.fget, ChunkKey.prefix_hash.fget
_encode_json = json.JSONEncoder(separators=(",", ":")).encode
_decode_json = json.JSONDecoder().decode


def hashes_frame(op: str, ns: Namespace, keys: Sequence[ChunkKey]) -> bytes:
    """The frame of a key request in its compact form: ``{"op", "namespace", "hashes"}``,
    ``hashes`` the keys' prefix hashes back to back in hex (one JSON string instead of one
    per key: a lookup of 32 keys costs the client and the daemon a few microseconds each).

    Raises:
        ValueError: a key of another namespace, or of another prefix-hash size (nothing is
            sent). ProtocolError: a header larger than ``MAX_HEADER_BYTES``.
    """
    ns_id = ns.ns_id
    if set(map(type, keys)) <= _KEY_TYPE and all(map(eq, repeat(ns_id), map(_NS_ID, keys))):
        raw = b"".join(map(_PREFIX_HASH, keys))  # (the usual case, in C-level passes)
    else:
        check_key_types(keys)
        for k in keys:
            if k.ns_id != ns_id:
                raise ValueError(f"key {bytes(k).hex()[:16]}... is not of namespace "
                                 f"{ns_id.hex()[:16]}...")
        raw = b"".join([k.prefix_hash for k in keys])
    if keys and len(raw) != len(keys) * len(keys[0].prefix_hash):
        raise ValueError("keys of one request must have prefix hashes of one size")
    blob = b"".join((b'{"op":"', op.encode(), b'","namespace":', _ns_json(ns), b',"hashes":"',
                     raw.hex().encode(), b'"}'))
    if len(blob) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(blob)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREAMBLE.pack(MAGIC, len(blob)) + blob


def _ns_json(ns: Namespace) -> bytes:
    """``ns.to_dict()`` as compact JSON bytes (the last 64 namespaces' kept; the very last
    by identity, without hashing its 12 fields)."""
    last = _NS_LAST[0]
    if last[0] is ns:
        return last[1]
    blob = _NS_JSON.get(ns)
    if blob is None:
        if len(_NS_JSON) >= 64:
            _NS_JSON.clear()
        blob = _NS_JSON[ns] = json.dumps(ns.to_dict(), separators=(",", ":")).encode()
    _NS_LAST[0] = (ns, blob)
    return blob


_NS_JSON: dict[Namespace, bytes] = {}
_NS_LAST: list[tuple[Namespace | None, bytes]] = [(None, b"")]


def parse_hashes(ns: Namespace, hashes: Any, max_keys: int) -> list[ChunkKey]:
    """The keys of ``ns`` whose prefix hashes ``hashes`` holds back to back, in hex (the
    compact form of ``keys``: every key of a request is of its namespace); at most
    ``max_keys`` (413 beyond).

    Raises:
        ProtocolError: not a hex string of whole ``PREFIX_HASH_BYTES[ns.hash_algo]``-byte
            hashes, or too many.
    """
    size = PREFIX_HASH_BYTES[ns.hash_algo]
    if hashes.__class__ is not str or len(hashes) % (2 * size):
        raise ProtocolError(f"'hashes' must be a hex string of {size}-byte prefix hashes "
                              f"(namespace hash_algo {ns.hash_algo})")
    if len(hashes) // (2 * size) > max_keys:
        raise ProtocolError(f"{len(hashes) // (2 * size)} keys exceed the limit of "
                              f"{max_keys} per batch", 413)
    try:
        raw = bytes.fromhex(hashes)
    except ValueError:
        raise ProtocolError(f"'hashes' is not hex: {hashes[:64]!r}") from None
    # lengths checked together above; the hashes sliced and keyed in C-level passes
    n = len(raw)
    return trusted_keys(ns.ns_id, map(raw.__getitem__, map(slice, range(0, n, size),
                                                           range(size, n + size, size))))


def error_reply(status: int, message: str) -> dict:
    """The reply of a failed request."""
    return {"ok": False, "status": status, "error": message}


# ---- asyncio (daemon side) -------------------------------------------------------------------
async def read_frame(reader: asyncio.StreamReader) -> tuple[dict, int] | None:
    """The next frame's ``(header, payload bytes)`` (the payload is left in ``reader``), or
    None at a clean end of stream (between frames).

    Raises:
        ProtocolError: a malformed preamble or header. asyncio.IncompleteReadError: the stream
            ended inside a frame.
    """
    try:
        pre = await reader.readexactly(PREAMBLE_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise
    n = decode_preamble(pre)
    return decode_header(await reader.readexactly(n))


# ---- blocking (client side) ------------------------------------------------------------------
def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``.

    Raises:
        ConnectionError: the peer closed the connection first.
    """
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("daemon closed the connection")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return buf


def recv_frame(sock: socket.socket, fds: list[int] | None = None) -> tuple[dict, int]:
    """The next frame's ``(header, payload bytes)`` from a blocking socket (the payload is
    left in the socket). With ``fds`` (a list), file descriptors passed with the frame's first
    bytes (``SCM_RIGHTS``) are appended to it.

    Raises:
        ProtocolError: a malformed frame. ConnectionError: the daemon closed the connection.
    """
    if fds is None:
        pre = bytes(recv_exact(sock, PREAMBLE_BYTES))
    else:
        pre, got = recv_with_fds(sock, PREAMBLE_BYTES)
        fds.extend(got)
        if len(pre) < PREAMBLE_BYTES:
            pre += bytes(recv_exact(sock, PREAMBLE_BYTES - len(pre)))
    n = decode_preamble(pre)
    return decode_header(bytes(recv_exact(sock, n)))


def recv_with_fds(sock: socket.socket, maxlen: int, maxfds: int = 4) -> tuple[bytes, list[int]]:
    """Up to ``maxlen`` bytes and the descriptors passed with them (``SCM_RIGHTS``).

    Raises:
        ConnectionError: the peer closed the connection.
    """
    fds = array.array("i")
    msg, anc, _flags, _addr = sock.recvmsg(maxlen, socket.CMSG_SPACE(maxfds * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    if not msg:
        for fd in fds:
            _close(fd)
        raise ConnectionError("daemon closed the connection")
    return msg, list(fds)


def send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send ``data`` with ``fds`` attached to its first byte (``SCM_RIGHTS``); the rest of
    ``data``, if the socket did not take it at once, is sent plainly."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sent = sock.sendmsg([data], anc)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)[1]


def _close(fd: int) -> None:
    import os
    try:
        os.close(fd)
    except OSError:
        pass


__all__ = ["SHM_VERSION", "SHM_VERSIONS", "OPS", "MAX_HEADER_BYTES", "PREAMBLE",
           "ProtocolError", "encode_frame", "decode_header", "hashes_frame", "parse_hashes",
           "error_reply", "read_frame", "recv_exact", "recv_exact_into", "recv_frame",
           "recv_with_fds", "send_with_fds", "peer_uid"]
