"""Compile, at engine start, the kernels a step runs outside its CUDA graph, at every
row count a step can have.

A decode graph pads its batch to a captured size, but the LM head and the sampler
run after it on the step's real rows, and Triton compiles a kernel variant for
each row-count class and tile choice (``kernels/triton/linear.py``'s configs
change with the row count) the first time it meets one. Met while serving, each
is a compile of a few hundred milliseconds inside the engine loop, stalling
every request on the worker (a decode worker filling up under a burst met one
every few steps). ``warm_sampling_kernels`` runs the LM head and both sampling
paths (greedy, and temperature with top-k and top-p) once at each row count up to
``max_rows``, so serving meets none.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.request import Request

GREEDY = SamplingParams(temperature=0.0)
# Seeded: its draws come from the requests' own generators, not the engine's shared one.
RANDOM = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=0)


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
