"""Text that came from outside the process (a participant's error reply, a tensor's name) as it
may enter a log line, an exception's message or run.db."""
from __future__ import annotations


def one_line(text: str, limit: int) -> str:
    """`text` as one line of at most `limit` characters: runs of whitespace (newlines included) as
    one space, anything else not printable (a terminal escape, NUL, a right-to-left override) as
    '?'.  Text that is already such a line is returned as it is."""
    if len(text) <= limit and text.isprintable() and "  " not in text and text == text.strip():
        return text
    return "".join(ch if ch.isprintable() else "?" for ch in " ".join(text.split())[:limit])


#: the longest error text kept from a peer's reply or a refused message (a refusal that lists the
#: allowed values stays whole; a 200 kB message is cut)
MAX_ERROR_TEXT = 2000
