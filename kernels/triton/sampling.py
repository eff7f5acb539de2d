"""Triton top-k / top-p sampling from probabilities; reference: ``splitserve.kernels.sampling``.

No sort. One program per row finds a keep threshold ``t`` such that the kept
set is ``{token : p >= t}``, then a second kernel draws from it:

- top-k: ``t_k`` = the largest ``t`` with ``count(p >= t) >= k`` (the k-th
  largest probability);
- top-p over the top-k set: ``t`` = the largest ``t >= t_k`` with
  ``mass(p >= t) >= top_p * mass(p >= t_k)``. A token is kept exactly when the
  mass strictly above it is below ``top_p`` of the top-k mass, as in the
  reference.

Both are searches over the bits of non-negative float32 values (ordered like
the values), ``NUM_CAND`` candidate thresholds per pass over the row, so a
search takes about 8 passes. Ties at the threshold are all kept (the reference
keeps exactly k, choosing among ties arbitrarily). The draw is an exponential
race ``argmax(p / q)`` over the kept tokens, ``q = -log(u)`` with ``u`` from
Philox (``tl.rand``) keyed by the row's seed: a row's draw depends only on its
seed and its probabilities.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_CAND = 16
BLOCK_V = 256  # threshold search: [BLOCK_V, NUM_CAND] compare tiles
SAMPLE_TILE = 1024  # draws x tokens of one sampling program


@triton.jit
def _measure_at_least(row_ptr, vocab, cand, MASS: tl.constexpr, BLOCK_V: tl.constexpr):
    """For each candidate bit pattern c: count (or mass) of tokens with bits(p) >= c."""
    total = tl.zeros(cand.shape, dtype=tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(row_ptr + offs, mask=offs < vocab, other=0.0).to(tl.float32)
        bits = tl.where(offs < vocab, p.to(tl.int32, bitcast=True), -1)
        above = bits[:, None] >= cand[None, :]
        if MASS:
            total += tl.sum(tl.where(above, p[:, None], 0.0), axis=0)
        else:
            total += tl.sum(above.to(tl.float32), axis=0)
    return total


@triton.jit
def _largest_reaching(
    row_ptr, vocab, target, lo, MASS: tl.constexpr, NUM_CAND: tl.constexpr, BLOCK_V: tl.constexpr
):
    """The largest bit pattern b >= lo whose count (or mass) of ``p >= b`` reaches ``target``.

    Invariant: ``lo`` reaches the target, ``hi`` does not; each pass tries
    ``NUM_CAND`` evenly spaced candidates in between and keeps the tightest pair.
    """
    hi = lo * 0 + 0x7F800000
    j = tl.arange(0, NUM_CAND) + 1
    while hi - lo > 1:
        step = (hi - lo + NUM_CAND) // (NUM_CAND + 1)
        cand = lo + j * step
        inside = cand < hi
        reach = (_measure_at_least(row_ptr, vocab, cand, MASS, BLOCK_V) >= target) & inside
        lo = tl.maximum(lo, tl.max(tl.where(reach, cand, lo), axis=0))
        hi = tl.minimum(hi, tl.min(tl.where(inside & ~reach, cand, hi), axis=0))
    return lo


@triton.jit
def _threshold_kernel(
    probs_ptr,
    top_k_ptr,
    top_p_ptr,
    threshold_ptr,
    vocab,
    stride_row,
    NUM_CAND: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = probs_ptr + row * stride_row
    k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    threshold = tl.zeros([], dtype=tl.int32)
    if (k > 0) & (k < vocab):
        threshold = _largest_reaching(row_ptr, vocab, k.to(tl.float32), threshold, False,
                                      NUM_CAND, BLOCK_V)  # fmt: skip
    if top_p < 1.0:
        cand = threshold + tl.zeros([2], dtype=tl.int32)  # (two equal lanes: a block shape)
        kept_mass = tl.max(_measure_at_least(row_ptr, vocab, cand, True, BLOCK_V), axis=0)
        # a positive target keeps the top token even for top_p <= 0
        target = tl.maximum(top_p * kept_mass, 1e-38)
        threshold = _largest_reaching(row_ptr, vocab, target, threshold, True, NUM_CAND, BLOCK_V)
    tl.store(threshold_ptr + row, threshold.to(tl.float32, bitcast=True))


@triton.jit
def _sample_kernel(
    probs_ptr,
    threshold_ptr,
    seed_ptr,
    out_ptr,  # [batch, num_samples] int64
    vocab,
    num_samples,
    stride_row,
    BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    samples = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    threshold = tl.load(threshold_ptr + row)
    seed = tl.load(seed_ptr + row)
    best_score = tl.zeros([BLOCK_S], dtype=tl.float32) - 1.0
    best_id = tl.zeros([BLOCK_S], dtype=tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(probs_ptr + row * stride_row + offs, mask=offs < vocab, other=0.0)
        kept = (offs < vocab) & (p.to(tl.float32) >= threshold)
        u = tl.rand(seed, samples[:, None] * vocab + offs[None, :])
        q = -tl.log(u)  # Exp(1); u = 0 gives q = inf, a score of 0
        score = tl.where(kept[None, :], p.to(tl.float32)[None, :] / q, -1.0)
        block_best = tl.max(score, axis=1)
        block_id = tl.min(tl.where(score == block_best[:, None], offs[None, :], vocab), axis=1)
        best_id = tl.where(block_best > best_score, block_id, best_id)
        best_score = tl.maximum(block_best, best_score)
    out = out_ptr + row * num_samples + samples
    tl.store(out, best_id.to(tl.int64), mask=samples < num_samples)


def top_k_top_p_thresholds(
    probs: torch.Tensor,  # [batch, vocab] float, rows sum to 1
    top_k: torch.Tensor | int,  # [batch] int; 0 or >= vocab: off
    top_p: torch.Tensor | float,  # [batch] float; 1.0: off
) -> torch.Tensor:  # [batch] float32
    """Per row, the threshold ``t``: top-k then top-p keep exactly the tokens with ``p >= t``."""
    batch, vocab = probs.shape
    probs = _rows(probs)
    top_k = _per_row(top_k, batch, torch.int32, probs.device)
    top_p = _per_row(top_p, batch, torch.float32, probs.device)
    thresholds = torch.empty(batch, dtype=torch.float32, device=probs.device)
    if batch:
        _threshold_kernel[(batch,)](
            probs, top_k, top_p, thresholds, vocab, probs.stride(0),
            NUM_CAND=NUM_CAND, BLOCK_V=BLOCK_V, num_warps=4,
        )  # fmt: skip
    return thresholds


def sample_from_probs(
    probs: torch.Tensor,  # [batch, vocab]
    thresholds: torch.Tensor,  # [batch] float32: draw among p >= threshold
    seeds: torch.Tensor,  # [batch] int64 Philox keys
    num_samples: int = 1,
) -> torch.Tensor:  # [batch, num_samples] int64
    """Independent draws per row, each with probability proportional to ``p`` among
    ``p >= threshold``; draw ``s`` of a row uses Philox counters ``s * vocab + token``."""
    batch, vocab = probs.shape
    if num_samples * vocab >= 2**31:
        raise ValueError(f"num_samples * vocab = {num_samples * vocab} must be < 2**31")
    probs = _rows(probs)
    thresholds = thresholds.float().contiguous()
    seeds = seeds.to(torch.int64).contiguous()
    out = torch.empty(batch, num_samples, dtype=torch.int64, device=probs.device)
    block_v = min(SAMPLE_TILE, triton.next_power_of_2(vocab))
    block_s = min(triton.next_power_of_2(num_samples), SAMPLE_TILE // block_v)
    if batch:
        _sample_kernel[(batch, triton.cdiv(num_samples, block_s))](
            probs, thresholds, seeds, out, vocab, num_samples, probs.stride(0),
            BLOCK_S=block_s, BLOCK_V=block_v, num_warps=4,
        )  # fmt: skip
    return out


def top_k_top_p_sample(
    probs: torch.Tensor,  # [batch, vocab]
    top_k: torch.Tensor | int,
    top_p: torch.Tensor | float,
    seeds: torch.Tensor | None = None,  # [batch] int64; None: drawn from ``generator``
    generator: torch.Generator | None = None,  # on probs' device
) -> torch.Tensor:  # [batch] int64
    """Top-k, then top-p, then one draw per row (see the module docstring)."""
    if seeds is None:
        seeds = torch.randint(
            2**62, (probs.shape[0],), device=probs.device, generator=generator, dtype=torch.int64
        )
    return sample_from_probs(probs, top_k_top_p_thresholds(probs, top_k, top_p), seeds)[:, 0]


def _per_row(value, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device)
    return t.expand(batch).contiguous() if t.dim() == 0 else t.to(dtype).contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
