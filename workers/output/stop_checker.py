"""Stop strings, checked on the accumulated output text after each new piece."""

from __future__ import annotations


def find_stop_string(
    text: str, new_text_len: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, str] | None:
    """Find a stop string that ends in the last ``new_text_len`` chars of ``text``.

    Only that tail (plus ``len(s) - 1`` chars before it) is searched, so a stop
    string split across tokens is found once its last piece arrives. The earliest
    match wins (ties: the first in ``stop``). Returns ``(text truncated before the
    stop string, or just after it when include_stop_str_in_output, matched stop)``.
    """
    best: tuple[int, str] | None = None
    for s in stop:
        i = text.find(s, max(0, len(text) - new_text_len - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    return text[: i + len(s) if include_stop_str_in_output else i], s


def stop_holdback(text: str, stop: list[str]) -> int:
    """Number of trailing chars of ``text`` that could begin a stop string; a streamer
    holds them back until the next piece shows whether the stop completes."""
    return max(
        (k for s in stop for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
        default=0,
    )
