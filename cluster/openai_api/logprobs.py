"""Logprobs in OpenAI's two formats, and the string shown for each token.

Completions give parallel lists ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``
(``top_logprobs``: one dict token -> logprob per step); chat gives
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

A token's string is its text decoded alone (a SentencePiece ``▁`` shown as the space it is).
A token holding only part of a UTF-8 character (byte-level BPE splits CJK and emoji into byte
tokens) is shown as ``"bytes:\\xe4\\xbd"``, as OpenAI's legacy API did; chat's ``bytes`` has
its exact bytes either way, taken from the vocabulary piece.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from typing import Any

from splitserve.workers.sampling.sampler import TokenLogprobs

MIN_LOGPROB = -9999.0  # JSON has no -Infinity
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of GPT-2's byte-level BPE: printable bytes stand for themselves, the
    others (control characters, space, ...) for chr(256 + k) in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + k): b for k, b in enumerate(shifted)})
    return table


_BYTE_LEVEL = _byte_level_alphabet()


@dataclass(frozen=True)
class TokenText:
    token: str  # shown in "token" and as a key of completions' top_logprobs
    raw: bytes  # the token's bytes
    in_text: bool  # False for special tokens, which the output text skips


class TokenTexts:
    """token id -> TokenText, cached per id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._size = len(tokenizer)
        self._cache: dict[int, TokenText] = {}

    def __call__(self, token_id: int) -> TokenText:
        if token_id not in self._cache:
            self._cache[token_id] = self._make(token_id)
        return self._cache[token_id]

    def _make(self, token_id: int) -> TokenText:
        if not 0 <= token_id < self._size:  # padded embedding rows past the tokenizer
            return TokenText("", b"", False)
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        raw = _raw_bytes(text, piece)
        try:
            token = raw.decode("utf-8")
        except UnicodeDecodeError:
            token = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        skipped = self.tokenizer.decode([token_id], skip_special_tokens=True) == ""
        return TokenText(token, raw, not (skipped and text))


def _raw_bytes(text: str, piece: str) -> bytes:
    if "\ufffd" not in text:
        if "\u2581" in piece:  # SentencePiece: decoding one token alone drops its leading space
            return piece.replace("\u2581", " ").encode()
        return text.encode()
    match = _BYTE_FALLBACK.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if piece and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return text.encode()


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class CompletionLogprobs:
    """Formats steps for /v1/completions; ``text_offset`` runs on across calls (one stream)."""

    def __init__(self, texts: TokenTexts, start_offset: int = 0) -> None:
        self.texts = texts
        self._offset = start_offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def format(self, steps: list[TokenLogprobs]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for step in steps:
            chosen = self.texts(step.token_id)
            out["tokens"].append(chosen.token)
            out["token_logprobs"].append(_clamp(step.logprob))
            out["top_logprobs"].append({self.texts(t).token: _clamp(lp) for t, lp in step.top})
            out["text_offset"].append(self._offset)
            if chosen.in_text:  # characters complete once their last byte arrives
                self._offset += len(self._utf8.decode(chosen.raw))
        return out


class ChatLogprobs:
    """Formats steps for /v1/chat/completions."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts

    def format(self, steps: list[TokenLogprobs]) -> dict[str, list[Any]]:
        return {"content": [self._entry(s) for s in steps]}

    def _entry(self, step: TokenLogprobs) -> dict[str, Any]:
        entry = self._token(step.token_id, step.logprob)
        entry["top_logprobs"] = [self._token(t, lp) for t, lp in step.top]
        return entry

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.texts(token_id)
        return {"token": text.token, "logprob": _clamp(logprob), "bytes": list(text.raw)}
