"""Start check of an engine's lossy codec (``--kvstore-lossy-codec``, ``StoreSpec.lossy_codec``)
against the store it opened: a lossy codec gives the engine's chunks keys of their own (never
shared with bit-exact engines, ``Namespace.lossy_codec``), and saves bytes only where a tier
or the wire encodes with it. With none that does, the engine pays the separate keys for
nothing; one WARNING at start says so, naming both sides.

Where the codec is used:

* the in-process store's disk tier (``disk_path``) and remote tier (``remote_url``), which
  the connector configures with the engine's codec (``StoreSpec.store_config``);
* a daemon's disk or remote tier whose codec (``kvstore serve --disk-codec`` /
  ``--remote-codec``) is the engine's, as its ``GET /v1/whoami`` (or same-host ``hello``)
  names them in ``tier_codecs``;
* the wire to a daemon (``--kvstore-wire-codec``) when the daemon accepts that codec
  (``wire_codecs``).

A daemon that did not answer, or one too old to name its codecs, is not judged (no warning).
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvstore.connectors.codec_check")

_warned: set[str] = set()
_warned_lock = threading.Lock()


def lossy_codec_warning(lossy_codec: str, local_codecs: dict[str, str] | None,
                        daemon: dict | None, wire_codec: str = "",
                        daemon_url: str | None = None) -> str | None:
    """The start warning for ``lossy_codec``, or None when something uses it (or it is
    ``""``, or a daemon's codecs are unknown).

    Args:
        lossy_codec: the engine's lossy codec (``""``: bit-exact, nothing to check).
        local_codecs: the in-process store's lower tiers' codecs
            (``StoreConfig.tier_codecs()``: ``{"disk": "kivi"}``); None = no in-process store.
        daemon: the daemon's ``whoami`` answer (``{}`` when it could not be asked); None = no
            daemon.
        wire_codec: the daemon client's wire codec (``""``: raw).
        daemon_url: the daemon's URL, named in the warning.
    """
    if not lossy_codec:
        return None
    local_codecs = local_codecs or {}
    if lossy_codec in local_codecs.values():
        return None
    remote_codecs = None
    if daemon is not None:
        remote_codecs = daemon.get("tier_codecs")
        if not isinstance(remote_codecs, dict):
            return None   # an old daemon, or one that did not answer: unknown
        wire = daemon.get("wire_codecs")
        if lossy_codec in remote_codecs.values() or (
                wire_codec == lossy_codec and isinstance(wire, list) and wire_codec in wire):
            return None
    local = ", ".join(f"{t} {c}" for t, c in local_codecs.items()) or "no disk or remote tier"
    text = f"--kvstore-lossy-codec {lossy_codec}: no tier stores this engine's chunks with " \
           f"{lossy_codec}, yet they get keys of their own (never shared with bit-exact " \
           f"engines): no byte saved. In-process store: "
    if daemon is None:
        return text + (f"{local}; give it a disk tier (--kvstore-disk-path) or a remote tier "
                       f"(--kvstore-remote-url), or drop --kvstore-lossy-codec")
    daemon_side = ", ".join(f"{t} {c}" for t, c in remote_codecs.items()) \
        or "memory tiers only"
    return text + (f"{local if local_codecs else 'none'}; daemon {daemon_url or ''} tiers: "
                   f"{daemon_side}; wire: {wire_codec or 'raw'}. Start the daemon with "
                   f"--disk-codec {lossy_codec} (or --remote-codec {lossy_codec}), or send "
                   f"--kvstore-wire-codec {lossy_codec}, or drop --kvstore-lossy-codec")


def warn_unused_lossy_codec(lossy_codec: str, local_codecs: dict[str, str] | None,
                            daemon: dict | None, wire_codec: str = "",
                            daemon_url: str | None = None) -> str | None:
    """Log ``lossy_codec_warning``'s line (WARNING) once per process for each distinct
    line (an engine's two connector objects share a store: one line); returns the line or
    None. Arguments as ``lossy_codec_warning``."""
    text = lossy_codec_warning(lossy_codec, local_codecs, daemon, wire_codec, daemon_url)
    if text is None:
        return None
    with _warned_lock:
        if text in _warned:
            return text
        _warned.add(text)
    log.warning("%s", text)
    return text
