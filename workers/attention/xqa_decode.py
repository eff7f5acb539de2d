"""Decode attention over an FP8 KV cache with TensorRT-LLM's XQA kernel, as FlashInfer
ships it (``flashinfer.xqa``), for Hopper.

On SM90 an FP8 cache runs XQA's Hopper kernel: TMA loads of the pages, both products
on FP8 tensor cores. On its way q is rounded to e4m3 and the softmax's probabilities
are scaled to e4m3's range and rounded too (TensorRT-LLM's FP8 KV path), so it is less
exact than the Triton split-KV kernel, which widens the tiles to float16 and keeps q
as it is. It reads the layer's K and V scales on the device (a CUDA graph replays
whatever a calibration set), through the two it takes: one dequantization scale for
K and V (the V scale here), and q's, whose product with it divided by the square root
of the head size scales q·K (so q's is ``softmax scale * sqrt(head_dim) * k / v``).

It attends the pages as they are: the step's new rows go into the cache first. Its
index is the split-KV kernel's (block tables and lengths on the device), which XQA reads
in int32: a graph's static index is (no copy), an eager step's int64 one is converted
here (a copy a layer).
"""

from __future__ import annotations

import torch

WORKSPACE_BYTES = 128 << 20  # the first 8 MB: its semaphores, zero before the first call
SEMAPHORE_BYTES = 8 << 20


class XQADecode:
    def __init__(self, head_dim: int, device: torch.device):
        from flashinfer.xqa import xqa

        self._xqa = xqa
        self.head_dim = head_dim
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count

    def __call__(
        self,
        q: torch.Tensor,  # [batch, num_heads, head_dim]
        k_cache: torch.Tensor,  # NHD [num_blocks, block_size, num_kv_heads, head_dim] FP8
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [batch, blocks] int32 or int64
        seq_lens: torch.Tensor,  # [batch] int32 or int64, the new token's row included
        scale: float,  # the softmax's
        kv_scales: tuple[torch.Tensor, torch.Tensor],  # [1] float32 K and V scales
    ) -> torch.Tensor:
        block_tables, seq_lens = (t.to(torch.int32) for t in (block_tables, seq_lens))
        k_scale, v_scale = kv_scales
        q_scale = torch.div(k_scale, v_scale).mul_(scale * self.head_dim**0.5)
        q = q.contiguous().unsqueeze(1)  # [batch, beam 1, num_heads, head_dim]
        out = torch.empty_like(q)
        self._xqa(
            q, k_cache, v_cache, block_tables, seq_lens.unsqueeze(1), out,
            self.workspace[SEMAPHORE_BYTES:], self.workspace[:SEMAPHORE_BYTES],
            k_cache.shape[2], k_cache.shape[1], q_scale=q_scale, kv_scale=v_scale,
            sm_count=self.sm_count,
        )  # fmt: skip
        return out.squeeze(1)
