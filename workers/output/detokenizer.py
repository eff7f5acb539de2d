"""Incremental detokenization, vLLM style (prefix window + read offset).

The detokenizer keeps a short window of token ids::

    ids:  [ prefix: last emitted chunk (at first, the prompt tail) | pending ]
                                                                  ^ read_offset

Each step decodes the whole window and emits what it adds to the text of the
prefix. Decoding with left context keeps tokenizers that strip or merge at a
sequence start (leading spaces, byte fallback) right. While the text ends in
U+FFFD a multi-byte character is incomplete and nothing is emitted. On emission
the pending ids become the next prefix, so the window stays a few tokens long
and a step costs O(1).

A fast tokenizer's window is decoded by its Rust backend directly (what its
``decode`` calls, without about 4 us of Python around each call, and a token takes
1.5 calls) unless the tokenizer cleans up tokenization spaces after decoding; then,
and for any other tokenizer, by ``tokenizer.decode``.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import Tokenizer

INITIAL_CONTEXT = 5  # prompt tokens decoded as left context
MAX_PENDING = 8  # a UTF-8 character spans at most 4 byte tokens; beyond this, stop waiting


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = window_decoder(tokenizer, skip_special_tokens)
        self._vocab_size = len(tokenizer)
        self._ids = [t for t in prompt_token_ids[-INITIAL_CONTEXT:] if 0 <= t < self._vocab_size]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids)

    def add_token(self, token_id: int) -> str:
        """Append one output token; return the newly completed text (may be "")."""
        if not 0 <= token_id < self._vocab_size:
            return ""  # ids beyond the vocabulary decode to nothing
        self._ids.append(token_id)
        new_text = self._decode(self._ids)
        waiting = new_text.endswith("\ufffd") or len(new_text) <= len(self._prefix_text)
        if waiting and len(self._ids) - self._read_offset < MAX_PENDING:
            return ""  # an incomplete character, or a token without text (skipped special)
        return self._emit(new_text)

    def flush(self) -> str:
        """At the end of a request: emit what is held back (an incomplete character as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids))

    def _emit(self, new_text: str) -> str:
        piece = new_text[len(self._prefix_text) :]
        if new_text.endswith("\ufffd"):
            # Forced out while incomplete: drop the context so that later bytes cannot
            # complete a character whose U+FFFD was already emitted.
            self._ids, self._read_offset, self._prefix_text = [], 0, ""
        else:
            self._ids = self._ids[self._read_offset :]
            self._read_offset = len(self._ids)
            self._prefix_text = self._decode(self._ids)
        self._text += piece
        return piece

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return self._text


def window_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> text`` exactly as ``tokenizer.decode(ids, skip_special_tokens=...)``."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    ):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
