"""What a daemon put did, as the clients return it: ``PutResult`` is the number of chunks
newly stored (an ``int``, so callers that count stored chunks go on as before) that also
carries the daemon's answer of ``already_stored``, ``refused`` and ``first_refused``
(``docs/wire-format.md``, "Put answer"; the same on HTTP and on the same-host socket).

A caller that must know whether a put's later chunks were stored reads ``first_refused``: a
chunk refused ``parent_missing`` or ``no_room`` means no chunk after it in that call was
stored by that request (on the default CPU arena the batch stops there).
"""
from __future__ import annotations

import logging
from typing import Iterable

log = logging.getLogger("kvstore.client")


class PutResult(int):
    """Chunks newly stored by a put (the ``int`` value), with what the daemon said of the rest.

    Attributes:
        stored: chunks newly stored, ``int(result)`` (read-only; the repr's ``stored=``).
        num_chunks: chunks the put sent.
        already_stored: chunks stored before the put (kept); None when the daemon's answer did
            not say (an older daemon).
        refused: chunks not stored; None when the daemon's answer did not say.
        first_refused: None, or ``{"index": i, "key": hex, "reason": "parent_missing" |
            "no_room"}`` for the first refused chunk, ``i`` counted from the first key of the
            call (over all its requests).
    """

    num_chunks: int
    already_stored: int | None
    refused: int | None
    first_refused: dict | None

    def __new__(cls, stored: int, num_chunks: int = 0, already_stored: int | None = None,
                refused: int | None = None, first_refused: dict | None = None) -> "PutResult":
        out = super().__new__(cls, int(stored))
        out.num_chunks, out.already_stored, out.refused = num_chunks, already_stored, refused
        out.first_refused = first_refused
        return out

    @property
    def stored(self) -> int:
        """Chunks newly stored by the put: the value itself, ``int(self)``."""
        return int(self)

    @classmethod
    def from_answer(cls, answer: dict, offset: int = 0) -> "PutResult":
        """The result of one put request's answer (a dict with ``stored``; the other fields
        when the daemon sends them). ``offset``: index of the request's first chunk in the
        call, added to ``first_refused["index"]``.

        Raises:
            KeyError: the answer has no ``stored``.
        """
        first = answer.get("first_refused")
        if isinstance(first, dict) and isinstance(first.get("index"), int):
            first = {**first, "index": first["index"] + offset}
        else:
            first = None
        refused = answer.get("refused")
        return cls(answer["stored"], int(answer.get("num_chunks") or 0),
                   answer.get("already_stored"), refused, first)

    @classmethod
    def combine(cls, parts: Iterable[int]) -> "PutResult":
        """One result for a call made of several requests in chunk order (each a
        ``PutResult`` with indices already counted from the call's first key, or a plain int
        of an older path): the sums, and the first ``first_refused``. A count is None when
        any part's is."""
        stored, n, held, refused, first = 0, 0, 0, 0, None
        for p in parts:
            stored += int(p)
            n += getattr(p, "num_chunks", 0)
            a, r = getattr(p, "already_stored", None), getattr(p, "refused", None)
            held = None if held is None or a is None else held + a
            refused = None if refused is None or r is None else refused + r
            first = first or getattr(p, "first_refused", None)
        out = cls(stored, n, held, refused, first)
        if first is not None:
            log.debug("put: %d of %d chunks stored, %s already, %s refused; first refused: "
                      "%s", stored, n, held, refused, first)
        return out

    def shifted(self, offset: int) -> "PutResult":
        """This result with ``first_refused["index"]`` moved by ``offset`` (the index of
        this request's first chunk in the call)."""
        first = self.first_refused
        if first is not None and offset:
            first = {**first, "index": first["index"] + offset}
        return PutResult(int(self), self.num_chunks, self.already_stored, self.refused, first)

    def __repr__(self) -> str:
        return (f"PutResult(stored={int(self)}, num_chunks={self.num_chunks}, "
                f"already_stored={self.already_stored}, refused={self.refused}, "
                f"first_refused={self.first_refused})")


__all__ = ["PutResult"]
