"""Logits processors that run before temperature: penalties, min_tokens, bad words.

Each takes float32 logits ``[B, V]`` (row i belongs to ``requests[i]``) and edits
them in place. Token ids outside ``[0, V)`` in a request's history are ignored.
"""

from __future__ import annotations

import torch

from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.request import Request
from splitserve.workers.runner.input_batch import to_device


def _token_counts(seqs: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[B, V]`` float32 occurrence counts of each token id in each row's sequence."""
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(len(seqs), vocab_size + 1, device=device)
    if width:
        ids = torch.full((len(seqs), width), vocab_size, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        ids = ids.masked_fill_((ids < 0) | (ids > vocab_size), vocab_size).to(device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab_size]  # the last column collected padding and out-of-range ids


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Repetition penalty over prompt + output, then OpenAI frequency/presence over output.

    ``repetition``: a seen token's logit is divided by the penalty when positive,
    multiplied when negative. ``frequency``/``presence``:
    ``logit -= frequency * count + presence * (count > 0)``.
    """
    params = [r.sampling_params for r in requests]
    use_rep = [_repetition(p) for p in params]
    use_fp = [_frequency_or_presence(p) for p in params]
    if not any(use_rep) and not any(use_fp):
        return
    vocab_size, device = logits.shape[1], logits.device
    outputs = [
        r.output_token_ids if rep or fp else [] for r, rep, fp in zip(requests, use_rep, use_fp)
    ]
    out_counts = _token_counts(outputs, vocab_size, device)
    if any(use_rep):
        prompts = [r.prompt_token_ids if rep else [] for r, rep in zip(requests, use_rep)]
        seen = (_token_counts(prompts, vocab_size, device) > 0) | (out_counts > 0)
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        torch.where(seen, penalized, logits, out=logits)
    if any(use_fp):
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        logits -= freq * out_counts + pres * (out_counts > 0)


def edits_logits(requests: list[Request]) -> bool:
    """Whether a processor here may change any of these rows (penalties, a min_tokens not
    yet reached, bad words); if not, the sampler can read the model's logits as they are."""
    return any(
        _repetition(p) or _frequency_or_presence(p) or _min_tokens_pending(r) or p.bad_words
        for r in requests
        for p in (r.sampling_params,)
    )


def _repetition(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0


def _frequency_or_presence(p: SamplingParams) -> bool:
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _min_tokens_pending(r: Request) -> bool:
    return r.num_output_tokens < r.sampling_params.min_tokens  # pending tokens count


def _ban(logits: torch.Tensor, rows: list[int], cols: list[int]) -> None:
    if rows:
        index = (to_device(rows, logits.device), to_device(cols, logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))


def apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """Ban EOS and ``stop_token_ids`` while fewer than ``min_tokens`` tokens were generated."""
    rows, cols = [], []
    for i, r in enumerate(requests):
        p = r.sampling_params
        if _min_tokens_pending(r):
            banned = {t for t in (*r.eos_token_ids, *p.stop_token_ids) if t < logits.shape[1]}
            rows += [i] * len(banned)
            cols += banned
    _ban(logits, rows, cols)


class BadWords:
    """vLLM ``bad_words``: each word is tokenized as-is and with a leading space; for a
    token sequence ``[t1..tn]``, ``tn`` is banned whenever the output ends with
    ``[t1..tn-1]`` (a one-token word is always banned). Token ids are cached per request.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_ids: dict[str, list[tuple[int, ...]]] = {}

    def token_ids(self, request: Request) -> list[tuple[int, ...]]:
        ids = self._token_ids.get(request.request_id)
        if ids is None:
            seqs: dict[tuple[int, ...], None] = {}  # ordered, deduplicated
            for word in request.sampling_params.bad_words:
                for text in (word, " " + word.lstrip()):
                    seq = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                    if seq:
                        seqs[seq] = None
            ids = self._token_ids[request.request_id] = list(seqs)
        return ids

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> None:
        rows, cols = [], []
        for i, r in enumerate(requests):
            if not r.sampling_params.bad_words:
                continue
            out = r.output_token_ids
            for seq in self.token_ids(r):
                prefix = seq[:-1]
                if seq[-1] < logits.shape[1] and (
                    not prefix or tuple(out[len(out) - len(prefix) :]) == prefix
                ):
                    rows.append(i)
                    cols.append(seq[-1])
        _ban(logits, rows, cols)

    def release(self, request_id: str) -> None:
        self._token_ids.pop(request_id, None)
