"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily


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
        def bad(name: str, accepted: str) -> ValueError:
            return ValueError(f"invalid {name}={getattr(self, name)!r}: must be {accepted}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if not self.temperature >= 0.0:
            raise bad("temperature", ">= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 1, or 0 / -1 to disable")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0 (1 disables it)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer or None")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "an integer >= 0 or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise bad("bad_words", "a list of non-empty strings")

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
