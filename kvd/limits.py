"""Bounds on what a caller chooses: how long its strings may be, how much of one a message quotes.

* Every string a request carries is at most :data:`MAX_ID_BYTES` bytes of UTF-8 (request ids,
  session names, the boot id a caller quotes, a sender's name), except reasons (Abort,
  AbortReceive, AbortSend): :data:`MAX_REASON_BYTES`, and a proposed layout (ProposeLayout):
  :data:`MAX_LAYOUT_BYTES`. :func:`kvd.rpc.convert.parse_request` checks every
  string field of every request against them before any handler runs, on gRPC and on the peer
  socket; the proto documents them. Longer is InvalidArgument, naming the field, the limit and
  the length.
* A message that names a caller's string quotes it with :func:`quote` (at most
  :data:`QUOTE_CHARS` characters of it), and a status carries at most :data:`MAX_MESSAGE_BYTES`
  of message (:func:`kvd.errors.to_status` cuts a longer one with :func:`clip`): trailing
  metadata over gRPC's limit (8 KiB by default) would reach the caller as a bare
  RESOURCE_EXHAUSTED instead of kvd's error.

Imports nothing of kvd (the exception tree cuts its messages with :func:`clip`): the core quotes
with these too.
"""

from __future__ import annotations

__all__ = ["MAX_ID_BYTES", "MAX_REASON_BYTES", "MAX_LAYOUT_BYTES", "MAX_MESSAGE_BYTES", "QUOTE_CHARS", "clip", "quote", "too_long", "utf8_len"]

#: Bytes of UTF-8 in a request id, session name, quoted boot id or sender name.
MAX_ID_BYTES = 256
#: Bytes of UTF-8 in a reason (Abort, a peer's AbortReceive / AbortSend).
MAX_REASON_BYTES = 1024
#: Bytes of UTF-8 in a layout's JSON (ProposeLayout): a few groups take well under 1 KiB.
MAX_LAYOUT_BYTES = 64 << 10
#: Bytes of UTF-8 of a status message on any transport (gRPC percent-encodes it into the
#: trailing metadata, where non-ASCII bytes take three each).
MAX_MESSAGE_BYTES = 2048
#: Characters of a caller's string that a message quotes.
QUOTE_CHARS = 64


def utf8_len(s: str) -> int:
    """Bytes of ``s`` in UTF-8 (a lone surrogate, which no wire string holds, counts as 3)."""
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))


def quote(s: str, n: int = QUOTE_CHARS) -> str:
    """``repr(s)`` when ``s`` has at most ``n`` characters, else the repr of its first ``n`` and
    its length in bytes: ``'abcd'…(1,048,576 bytes)``. For every message that names a caller's string."""
    if len(s) <= n:
        return repr(s)
    return f"{s[:n]!r}…({utf8_len(s):,d} bytes)"


def clip(s: str, limit: int) -> str:
    """``s`` if it is at most ``limit`` bytes of UTF-8, else its longest prefix (whole characters)
    that fits with a note of how much was cut."""
    if utf8_len(s) <= limit:
        return s
    note = f"…(cut: {utf8_len(s):,d} bytes in all)"
    head = s.encode("utf-8", "surrogatepass")[: max(0, limit - len(note.encode()))]
    return head.decode("utf-8", "ignore") + note


def too_long(value: str, limit: int) -> int:
    """The length of ``value`` in bytes of UTF-8 when it exceeds ``limit``, else 0 (fast for the
    short strings nearly every call carries)."""
    if len(value) * 4 <= limit:  # no str of this many characters is longer in UTF-8
        return 0
    n = utf8_len(value)
    return n if n > limit else 0
