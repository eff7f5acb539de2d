"""One owner for every CUDA graph of a worker.

Decode graphs, piecewise prefill graphs and MTP draft graphs (``draft_runner.py``) register
here, those the worker's role can replay (``roles.py``). They share one memory pool and one
capture stream, are captured together (largest size first, with a progress bar; the log
line names the role, each runner's sizes and the GPU memory each took, and
``captured_bytes`` keeps those figures) and
are dropped together: ``clear()`` runs before weights are freed or reloaded,
because a graph keeps the addresses of the weights it was captured with. The
next step that could use a graph captures them again.
"""

from __future__ import annotations

import gc
import logging
from typing import Protocol

import torch
from tqdm import tqdm

from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

CAPTURE_ERROR_MODE = "thread_local"  # a transport thread may use the GPU during a capture


class GraphRunner(Protocol):
    name: str

    def capture_sizes(self) -> list[int]:
        """Token counts to capture, largest first."""

    def capture(self, size: int, owner: GraphOwner) -> None: ...

    def can_run(self, forward_batch: ForwardBatch) -> bool: ...

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of the batch's real tokens, ``[num_tokens, hidden]``."""

    def clear(self) -> None:
        """Drop every graph and every per-batch buffer or index map."""


class GraphOwner:
    def __init__(self, device: torch.device, attn_backend: AttentionBackend, role: str = "mixed"):
        self.device = device
        self.attn_backend = attn_backend
        self.role = role
        self.captured_bytes: dict[str, int] = {}  # runner name -> GPU memory its capture took
        self.runners: list[GraphRunner] = []
        self.pool: tuple | None = None
        self.stream: torch.cuda.Stream | None = None
        self.captured = False

    def register(self, runner: GraphRunner) -> None:
        self.runners.append(runner)

    def capture(self) -> None:
        """Capture every runner's sizes into one pool (largest first)."""
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)
        jobs = sum(len(r.capture_sizes()) for r in self.runners)
        with tqdm(total=jobs, desc="Capturing CUDA graphs", unit="graph") as bar:
            for runner in self.runners:
                free_before = torch.cuda.mem_get_info(self.device)[0]
                for size in runner.capture_sizes():
                    bar.set_postfix_str(f"{runner.name} {size} tokens")
                    runner.capture(size, self)
                    bar.update()
                torch.cuda.synchronize(self.device)
                used = free_before - torch.cuda.mem_get_info(self.device)[0]
                self.captured_bytes[runner.name] = used
        logger.info(
            "%s worker captured %d CUDA graphs using %.1f MiB: %s",
            self.role,
            jobs,
            sum(self.captured_bytes.values()) / 2**20,
            "; ".join(self._captured(r) for r in self.runners),
        )
        self.captured = True

    def _captured(self, runner: GraphRunner) -> str:
        mib = self.captured_bytes[runner.name] / 2**20
        return f"{runner.name} {sorted(runner.capture_sizes())} {mib:.1f} MiB"

    def runner_for(self, forward_batch: ForwardBatch) -> GraphRunner | None:
        return next((r for r in self.runners if r.can_run(forward_batch)), None)

    def clear(self) -> None:
        """Drop all graphs, their pool and every runner's buffers; capture again on next use."""
        for runner in self.runners:
            runner.clear()
        self.attn_backend.clear_graphs()
        self.pool = self.stream = None
        self.captured = False
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def bucket(sizes: list[int], num_tokens: int) -> int:
    """The smallest captured size that holds ``num_tokens`` (``sizes`` ascending)."""
    for size in sizes:
        if size >= num_tokens:
            return size
    raise ValueError(f"{num_tokens} tokens exceed the largest captured size {sizes[-1]}")
