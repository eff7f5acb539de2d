"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from splitserve.config import RequestLimits

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
INT32_MAX = 2**31 - 1  # counts and token ids
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch.Generator (and msgpack) takes


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) means all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        """Types and ranges: every value must be one the engine can represent (the seed
        fits a 64-bit generator, counts an int32, floats are finite), so no request can
        fail inside the engine loop or on its way there."""
        _check_int(self, "max_tokens", 1, INT32_MAX)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad(self, "min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        _check_int(self, "top_k", -1, INT32_MAX, " (0 or -1: all tokens)")
        if self.seed is not None:
            _check_int(self, "seed", SEED_MIN, SEED_MAX)
        if self.logprobs is not None:
            _check_int(self, "logprobs", 0, INT32_MAX)
        # name -> (lowest, whether the lowest is excluded, highest or None, what is accepted)
        floats = {
            "temperature": (0.0, False, None, ">= 0 (0 means greedy)"),
            "top_p": (0.0, True, 1.0, "in (0, 1]"),
            "min_p": (0.0, False, 1.0, "in [0, 1]"),
            "repetition_penalty": (0.0, True, None, "> 0 (1 disables it)"),
            "presence_penalty": (-2.0, False, 2.0, "in [-2, 2]"),
            "frequency_penalty": (-2.0, False, 2.0, "in [-2, 2]"),
        }
        for name, (low, open_low, high, accepted) in floats.items():
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise _bad(self, name, f"a finite number {accepted}")
            too_low = value <= low if open_low else value < low
            if too_low or (high is not None and value > high):
                raise _bad(self, name, accepted)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(self, name, "true or false")
        for name in ("stop", "bad_words"):
            values = getattr(self, name)
            if not isinstance(values, list) or not all(_is_text(s) for s in values):
                raise _bad(self, name, "a list of non-empty strings of valid Unicode")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            raise _bad(self, "stop_token_ids", f"a list of token ids in [0, {INT32_MAX}]")

    def check(self, limits: RequestLimits) -> None:
        """Every range again (the fields may have changed since construction) and the list
        sizes ``limits`` allows (``EngineConfig.limits``); ValueError naming the field and
        what it accepts."""
        self._check()
        if len(self.stop) > limits.max_stop_strings:
            raise _bad(self, "stop", f"at most {limits.max_stop_strings} strings")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > limits.max_stop_string_chars:
            raise _bad(
                self, "stop", f"strings of at most {limits.max_stop_string_chars} characters"
            )
        if len(self.stop_token_ids) > limits.max_stop_token_ids:
            raise _bad(self, "stop_token_ids", f"at most {limits.max_stop_token_ids} token ids")
        if len(self.bad_words) > limits.max_bad_words:
            raise _bad(self, "bad_words", f"at most {limits.max_bad_words} strings")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows; such requests want greedy anyway.
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def reads_output_tokens(self) -> bool:
        """Whether sampling reads the generated token ids on the host (penalties, bad
        words), so the previous step's token must be read back first."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.bad_words
        )


def _bad(params: SamplingParams, name: str, accepted: str) -> ValueError:
    try:
        value = repr(getattr(params, name))
    except ValueError:  # an int too long to print (Python's int_max_str_digits)
        value = "<a longer integer than can be printed>"
    value = value if len(value) <= 60 else value[:57] + "..."
    return ValueError(f"invalid {name}={value}: must be {accepted}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(params: SamplingParams, name: str, low: int, high: int, note: str = "") -> None:
    value = getattr(params, name)
    if not _is_int(value) or not low <= value <= high:
        raise _bad(params, name, f"an integer in [{low}, {high}]{note}")


def _is_text(value: Any) -> bool:
    """A non-empty string that encodes to UTF-8 (no lone surrogate)."""
    if not isinstance(value, str) or not value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
