"""Compile, at engine start, the kernels a step runs outside its CUDA graph: the LM
head and the sampler at every row count a step can have, and the eager forwards.

A decode graph pads its batch to a captured size, but the LM head and the sampler
run after it on the step's real rows, and Triton compiles a kernel variant for
each row-count class and tile choice (``kernels/triton/linear.py``'s configs
change with the row count) the first time it meets one. Met while serving, each
is a compile of a few hundred milliseconds inside the engine loop, stalling
every request on the worker (a decode worker filling up under a burst met one
every few steps). ``warm_sampling_kernels`` runs the LM head and both sampling
paths (greedy, and temperature with top-k and top-p) once at each row count up to
``max_rows``, so serving meets none.

A worker that captures no piecewise graphs (a decode worker, which still computes
short prompts itself, and every expert-parallel worker, whose prefill runs eager)
would meet its prefill kernels first inside a request: FlashInfer builds its prefill
module on first use, which takes a minute or more on a fresh machine, long enough
for the replica's watchdog to take the engine for hung and kill it (an EP2 decode
worker on 4 H200s did exactly that on its first short prompt).
``warm_eager_forwards`` runs the prefill forward once at a few prompt lengths and
once over a computed prefix, and an eager decode step as wide as the scheduler
allows (without graphs, FlashInfer's decode module takes those), as the group's
step on every rank of an expert group. With MTP it runs the drafter's eager passes
after each, at every batch width: a GLM-4.5-Air-shaped prefill worker with MTP met
compiles there under load (its first requests waited 0.5 to 2 s for their first
token, where the same server without MTP answered in 30 to 60 ms).
"""

from __future__ import annotations

import itertools

import torch
from tqdm import tqdm

from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.request import Request
from splitserve.workers.parallel.lockstep import agree_drafts
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch

GREEDY = SamplingParams(temperature=0.0)
# Seeded: its draws come from the requests' own generators, not the engine's shared one.
RANDOM = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=0)
# Prompt lengths the warm-up runs besides the step's token budget: row-count classes of
# the linears and the fused MoE that prompts meet, from short ones up.
PREFILL_WARMUP_TOKENS = (16, 256)


@torch.inference_mode()
def warm_sampling_kernels(model, sampler, device: torch.device, max_rows: int) -> None:
    """The LM head and the sampler at 1..``max_rows`` rows (CUDA only; a no-op elsewhere)."""
    if device.type != "cuda":
        return
    hidden_size = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    hidden = torch.randn(max_rows, hidden_size, dtype=dtype, device=device)
    for rows in tqdm(range(1, max_rows + 1), desc="Compiling sampling kernels", unit="size"):
        logits = model.compute_logits(hidden[:rows])
        for params in (GREEDY, RANDOM):
            requests = [Request(f"warmup-{i}", [0], params) for i in range(rows)]
            sampler.sample(logits, requests).result()
            for request in requests:
                sampler.release(request.request_id)
    torch.cuda.synchronize(device)


@torch.inference_mode()
def warm_eager_forwards(runner, max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """Eager forwards of one fresh prompt at each of ``PREFILL_WARMUP_TOKENS`` and
    ``max_tokens`` tokens (as far as the cache holds them), of a chunk over a computed
    prefix, and of a decode step of ``max_seqs`` requests (past the split-KV kernel's
    batch limit, FlashInfer's decode module); each as (requests, tokens), in order.
    With the MTP drafter, each is followed by the drafter's eager passes for its
    requests, and decode steps of every width from 1 request up come first, for the
    drafter's chained passes (a prefill worker drafts for the prompts a step finishes).

    Run at engine start, before any request holds a block: the KV goes to blocks
    1, 2, ... of the cache (any request writes a block before it reads it), and no
    block is allocated, hashed or left changed in the block manager.
    """
    block_size = runner.kv_cache.block_size
    most = min(max_tokens, (runner.kv_cache.num_blocks - 1) * block_size)
    lengths = sorted({n for n in (*PREFILL_WARMUP_TOKENS, max_tokens) if n <= most})
    prefix = min(PREFILL_WARMUP_TOKENS[0], most // 2)
    steps = [[_step(new, 0, block_size)] for new in lengths]
    drafter = runner.speculator.proposer if runner.speculator is not None else None
    if prefix:
        steps.append([_step(prefix, prefix, block_size)])
        widths = range(1, max_seqs + 1) if drafter is not None else [max_seqs]
        steps += [[_step(1, prefix, block_size)] * n for n in widths]  # one shared table
    for step in steps:
        fb = build_forward_batch(step, runner.kv_cache, runner.attn_backend, runner.device, False)
        rows = list(itertools.accumulate(len(r.new_token_ids) for r in step))
        draft_rows = [end - 1 for end in rows] if drafter is not None else []
        group = runner.group_step(step, False, len(draft_rows))
        hidden = runner.forward(fb, use_graphs=False, group=group)
        if drafter is not None:  # its eager passes, as a prefill worker's step runs them
            passes = agree_drafts(group, []) if group is not None else None
            drafter.propose(fb, hidden, [0] * rows[-1], draft_rows, None, passes)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return [(len(step), sum(len(r.new_token_ids) for r in step)) for step in steps]


def _step(new: int, computed: int, block_size: int) -> StepRequest:
    """``new`` tokens after ``computed`` ones, in blocks 1, 2, ..."""
    blocks = list(range(1, 1 + -(-(computed + new) // block_size)))
    return StepRequest([0] * new, computed, blocks, sample=True)
