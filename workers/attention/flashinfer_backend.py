"""FlashInfer paged attention for NVIDIA GPUs.

One ``plan()`` per step (it costs ~150 us of CPU), one ``run()`` per layer:

- decode steps (every request adds one token): the batch-decode wrapper;
- prefill steps with no cached prefix (every request's KV is this step's
  tokens): the ragged prefill wrapper over the step's own K and V, which the
  Hopper (FA3) kernels read with TMA instead of page by page;
- other prefill, mixed and verify steps: the paged prefill wrapper with a
  causal mask aligned to the end of each request's KV, so a chunk attends its
  cached prefix and itself, and a decode row in a mixed step is a one-token
  query.

Decode uses FlashInfer's tensor-core kernels when a KV head serves at least
``TENSOR_CORE_GROUP`` query heads (``decode_tensor_cores``): the CUDA-core
decode kernel is bound by its arithmetic there, not by the KV bytes. Decode
steps of at most ``split_kv_max_batch`` requests (``kernels.split_kv_max_batch``
in the config) run the Triton split-KV kernel instead
(``kernels/triton/decode_attention.py``): one launch for the splits, which also
stores the new K/V rows (and, up to 16 requests, norms and rotates q and K itself:
``AttentionKernel.norms_qk``), and one for their merge; no plan, and an index
(block table, lengths) that is the step's own tensors, or in a graph the runner's
static buffers (``AttentionKernel.reads_batch_index``).

Otherwise new K/V rows go into the cache with the Triton KV store before attention.

An FP8 KV cache (``float8_e4m3fn``, ``kv_dtype``) is planned with FlashInfer's
``kv_data_type`` and read by its kernels at half the bytes. FlashInfer's own
``k_scale`` / ``v_scale`` arguments are host floats (folded into the softmax scale
and multiplied into the output after the kernel), which a CUDA graph would freeze
before the first prompt calibrates them; so the backend does the same on the
device: q times the layer's K scale before the kernel, the output times its V scale
after. The Triton split-KV kernel takes the scales itself and stores the new rows
quantized (setting a scale still 0 as the KV store would); it norms q/k on load only
once the host has seen the scales set (``KVScales.calibrated``): rows it norms are
not in that calibration.

Those FP8 decode steps run the CUDA tensor-core kernel instead (``fp8_decode="mma"``,
``kernels/fp8_decode_cuda.py``; ``"auto"``, the default: wherever it runs, sm89+, head
dim 128, blocks of a multiple of 16 tokens) or TensorRT-LLM's XQA kernel
(``fp8_decode="xqa"``, ``xqa_decode.py``, Hopper only): the new rows stored first, the
same index.

Decode CUDA graphs get one decode wrapper per captured size, built over
static index buffers (``use_cuda_graph=True``); ``prepare_replay`` re-plans
it with the padded batch, which rewrites those buffers before the replay.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from splitserve.config import FP8_DECODE_KERNELS, KernelConfig
from splitserve.kernels.fp8_decode_cuda import TILE, FP8DecodeKernel
from splitserve.kernels.kv_store import FP8_DTYPE
from splitserve.kernels.triton.decode_attention import NORM_ROPE_MAX_BATCH, decode_attention
from splitserve.workers.attention.base import (
    AttentionBackend,
    AttentionKernel,
    AttentionSpec,
    QKNormRope,
)
from splitserve.workers.attention.xqa_decode import XQADecode
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.runner.forward_batch import ForwardBatch, Phase
from splitserve.workers.runner.input_batch import padded_block_tables

HEAD_DIMS = (64, 128, 256)  # head sizes FlashInfer's kernels are built for
WORKSPACE_BYTES = 256 << 20
TENSOR_CORE_GROUP = 4  # query heads per KV head from which decode runs on tensor cores


@dataclass
class PagedKVIndex:
    """The paged KV of a batch in CSR form, on the host (FlashInfer plans from it)."""

    kv_indptr: torch.Tensor  # [batch + 1] int32
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32 block ids
    kv_last_page_len: torch.Tensor  # [batch] int32, tokens in each request's last block
    qo_indptr: torch.Tensor  # [batch + 1] int32, query rows of each request

    @classmethod
    def of(cls, fb: ForwardBatch) -> PagedKVIndex:
        block_size = fb.kv_cache.block_size
        seq_lens = np.asarray(fb.seq_lens, dtype=np.int32)
        pages = -(-seq_lens // block_size)
        used = itertools.chain.from_iterable(
            blocks[:n] for blocks, n in zip(fb.block_ids, pages.tolist())
        )
        indices = np.fromiter(used, dtype=np.int32, count=int(pages.sum()))
        last = seq_lens - (pages - 1) * block_size
        qo = np.cumsum([0, *fb.query_lens], dtype=np.int32)
        indptr = np.cumsum(np.concatenate([[0], pages]), dtype=np.int32)
        return cls(*(torch.from_numpy(a) for a in (indptr, indices, last, qo)))


@dataclass
class FlashInferMetadata:
    wrapper: Any  # the FlashInfer wrapper planned for this step
    ragged: bool = False  # attends the step's own K/V (no cached prefix), not the pages


@dataclass
class SplitKVDecodeMetadata:
    """A decode step for the Triton split-KV kernel (or XQA in its place): the index it
    reads, on the device."""

    block_tables: torch.Tensor  # [batch, blocks] int
    seq_lens: torch.Tensor  # [batch] int
    may_norm_qk: bool = True  # FP8: only once the host has seen the scales set


def tensor_core_decode(num_heads: int, num_kv_heads: int) -> bool:
    """Whether decode runs FlashInfer's tensor-core kernels for this attention shape."""
    return num_heads // num_kv_heads >= TENSOR_CORE_GROUP


def attends_own_kv(fb: ForwardBatch, dtype: torch.dtype) -> bool:
    """A prefill whose requests have no KV beyond this step's tokens, into a cache that
    keeps K/V as computed (``dtype``): its attention can read the step's own K/V."""
    return (
        fb.phase == Phase.PREFILL
        and fb.kv_cache.layout.dtype == dtype
        and fb.query_lens == fb.seq_lens
    )


def flashinfer_supports(head_dim: int, device: torch.device) -> bool:
    """Whether the FlashInfer backend can serve this model on this device."""
    if device.type != "cuda" or head_dim not in HEAD_DIMS:
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        decode_tensor_cores: bool | None = None,  # None: from the query heads per KV head
        ragged_prefill: bool = True,
        # Decode batches up to this size run the Triton split-KV kernel; 0: FlashInfer
        # decodes every batch. The engine passes the config's ``kernels.split_kv_max_batch``.
        split_kv_max_batch: int = KernelConfig.split_kv_max_batch,
        kv_dtype: torch.dtype | None = None,  # the cache's: dtype (default) or FP8
        # FP8 decode steps of the split-KV kernel's batches (``kernels.fp8_decode``)
        fp8_decode: str = KernelConfig.fp8_decode,
    ):
        import flashinfer

        if head_dim not in HEAD_DIMS:
            raise ValueError(
                f"flashinfer attention needs head_dim in {HEAD_DIMS}, got {head_dim}; "
                "use attention_backend: torch"
            )
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"flashinfer attention runs float16 or bfloat16, got {dtype}; "
                "use attention_backend: torch"
            )
        kv_dtype = kv_dtype or dtype
        if kv_dtype not in (dtype, FP8_DTYPE):
            raise ValueError(
                f"flashinfer attention reads a KV cache in the model's dtype ({dtype}) or "
                f"{FP8_DTYPE}, got {kv_dtype}"
            )
        if fp8_decode not in FP8_DECODE_KERNELS:
            raise ValueError(f"fp8_decode must be one of {FP8_DECODE_KERNELS}, got {fp8_decode!r}")
        self._flashinfer = flashinfer
        self.kv_dtype = kv_dtype
        # FP8 decode steps of the split-KV batches: XQA, the tensor-core kernel or None
        # (the Triton kernel); "auto" and block sizes the tensor-core kernel cannot read
        # are settled at the first step (``_fp8_kernel``).
        self._fp8_decode = fp8_decode if kv_dtype == FP8_DTYPE else "split_kv"
        self._fp8_kernels: dict[int, Any] = {}  # by block size
        self._xqa: XQADecode | None = None
        if self._fp8_decode == "xqa":
            capability = torch.cuda.get_device_capability(device)
            if capability[0] != 9:
                raise ValueError(
                    "kernels.fp8_decode: xqa runs XQA's Hopper kernel, which needs an SM90 "
                    f"GPU (this one is sm_{capability[0]}{capability[1]}); use split_kv"
                )
            self._xqa = XQADecode(head_dim, device)
        if self._fp8_decode == "mma":  # what a block size does not settle, refused now
            _refuse_mma(FP8DecodeKernel.supports(device, head_dim, num_heads // num_kv_heads, TILE))
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        if decode_tensor_cores is None:
            decode_tensor_cores = tensor_core_decode(num_heads, num_kv_heads)
        self.decode_tensor_cores = decode_tensor_cores
        self.ragged_prefill = ragged_prefill
        self.split_kv_max_batch = split_kv_max_batch
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.ragged_wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = self._decode_wrapper()
        self.graph_wrappers: dict[int, Any] = {}  # captured size -> decode wrapper
        self._graph_buffers: dict[str, torch.Tensor] = {}
        self._last_plan: torch.cuda.Event | None = None  # after the last plan's copies

    # -- eager steps -----------------------------------------------------------

    def plan(self, forward_batch: ForwardBatch) -> None:
        with self._planning():
            self._plan(forward_batch)

    @contextlib.contextmanager
    def _planning(self):
        """Around every plan: FlashInfer stages a plan in a page-locked buffer and queues
        its copy to the device, and the wrapper's next plan overwrites that buffer. With
        async scheduling the host plans a step ahead, so it first waits for the last
        plan's copy (long done in a steady state: it ran at the start of the step the
        device is on)."""
        if self._last_plan is not None:
            self._last_plan.synchronize()
        yield
        self._last_plan = torch.cuda.Event()
        self._last_plan.record()

    def _plan(self, fb: ForwardBatch) -> None:
        if self._split_kv(fb, fb.num_tokens):
            fb.attn_metadata = self._split_kv_metadata(fb)
            return
        index = PagedKVIndex.of(fb)
        if fb.phase == Phase.DECODE:
            self._plan_decode(self.decode_wrapper, index, fb.kv_cache)
            fb.attn_metadata = FlashInferMetadata(self.decode_wrapper)
            return
        if self._can_run_ragged(fb):
            self.ragged_wrapper.plan(
                index.qo_indptr,
                index.qo_indptr,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                causal=True,
                sm_scale=self.head_dim**-0.5,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
            fb.attn_metadata = FlashInferMetadata(self.ragged_wrapper, ragged=True)
            return
        self.prefill_wrapper.plan(
            index.qo_indptr,
            index.kv_indptr,
            index.kv_indices.to(self.device, non_blocking=True),
            index.kv_last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            fb.kv_cache.block_size,
            causal=True,
            sm_scale=self.head_dim**-0.5,
            q_data_type=self.dtype,
            kv_data_type=fb.kv_cache.layout.dtype,
        )
        fb.attn_metadata = FlashInferMetadata(self.prefill_wrapper)

    def kernel(self, forward_batch: ForwardBatch) -> AttentionKernel:
        """A split-KV decode step reads its index as it is, and up to ``NORM_ROPE_MAX_BATCH``
        requests norms and rotates q and the new K rows as it loads them
        (``decode_attention.py``)."""
        meta = forward_batch.attn_metadata
        if not isinstance(meta, SplitKVDecodeMetadata):
            return AttentionKernel()
        norms_qk = meta.may_norm_qk and meta.seq_lens.shape[0] <= NORM_ROPE_MAX_BATCH
        return AttentionKernel(norms_qk=norms_qk, reads_batch_index=True)

    def _split_kv(self, fb: ForwardBatch, batch: int) -> bool:
        """Whether this decode step runs the Triton split-KV kernel (a cache in the model's
        dtype, or FP8 with its scales), or over FP8 with ``fp8_decode="xqa"`` XQA in its
        place: both read the same index (``SplitKVDecodeMetadata``)."""
        return (
            fb.phase == Phase.DECODE
            and batch <= self.split_kv_max_batch
            and fb.kv_cache.layout.dtype in (self.dtype, FP8_DTYPE)
        )

    def _fp8_kernel(self, kv_cache: KVCache) -> Any:
        """The kernel of this cache's FP8 decode steps in the split-KV kernel's place
        (called with its index), or None: the Triton kernel."""
        block_size = kv_cache.block_size
        if block_size not in self._fp8_kernels:
            kernel = self._xqa if self._fp8_decode == "xqa" else None
            if self._fp8_decode in ("auto", "mma"):
                group = self.num_heads // self.num_kv_heads
                why = FP8DecodeKernel.supports(self.device, self.head_dim, group, block_size)
                if self._fp8_decode == "mma":
                    _refuse_mma(why)
                kernel = FP8DecodeKernel() if why is None else None
            self._fp8_kernels[block_size] = kernel
        return self._fp8_kernels[block_size]

    def _can_run_ragged(self, fb: ForwardBatch) -> bool:
        return self.ragged_prefill and attends_own_kv(fb, self.dtype)

    def _decode_wrapper(self, **graph_buffers: Any) -> Any:
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores, **graph_buffers
        )

    def _plan_decode(self, wrapper: Any, index: PagedKVIndex, kv_cache: KVCache) -> None:
        wrapper.plan(
            index.kv_indptr,
            # On the device already: a graph wrapper copies host indices blocking.
            index.kv_indices.to(self.device, non_blocking=True),
            index.kv_last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            kv_cache.block_size,
            sm_scale=self.head_dim**-0.5,
            q_data_type=self.dtype,
            kv_data_type=kv_cache.layout.dtype,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionSpec,
        forward_batch: ForwardBatch,
        norm_rope: QKNormRope | None = None,
    ) -> torch.Tensor:
        kv_cache = forward_batch.kv_cache
        k_cache, v_cache = kv_cache.layer(layer.layer_id)
        scales = kv_cache.layer_scales(layer.layer_id)
        meta = forward_batch.attn_metadata
        fp8_kernel = self._fp8_kernel(kv_cache) if scales is not None else None
        if isinstance(meta, SplitKVDecodeMetadata) and fp8_kernel is not None:
            kv_cache.store(layer.layer_id, k, v, forward_batch.slot_mapping)
            return fp8_kernel(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, layer.scale, scales
            )
        if isinstance(meta, SplitKVDecodeMetadata):  # stores the new rows itself
            new_kv = (k, v, forward_batch.slot_mapping)
            return decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, layer.scale,
                new_kv=new_kv, norm_rope=None if norm_rope is None else norm_rope.kernel_args(),
                kv_scales=scales,
            )  # fmt: skip
        kv_cache.store(layer.layer_id, k, v, forward_batch.slot_mapping)
        if meta.ragged:
            return meta.wrapper.run(q, k, v)
        if scales is None:
            return meta.wrapper.run(q.contiguous(), (k_cache, v_cache))
        k_scale, v_scale = scales  # on the device: see the module docstring
        out = meta.wrapper.run((q.float() * k_scale).to(q.dtype), (k_cache, v_cache))
        return out.mul_(v_scale)

    # -- decode CUDA graphs ----------------------------------------------------

    def init_graph_buffers(self, max_num_tokens: int, max_blocks_per_seq: int) -> None:
        """Index buffers shared by every captured size (a replay re-plans them)."""
        int32 = {"dtype": torch.int32, "device": self.device}
        self._graph_buffers = {
            "kv_indptr": torch.zeros(max_num_tokens + 1, **int32),
            "kv_indices": torch.zeros(max_num_tokens * max_blocks_per_seq, **int32),
            "kv_last_page_len": torch.zeros(max_num_tokens, **int32),
        }
        self.graph_wrappers = {}

    def prepare_capture(self, num_tokens: int, forward_batch: ForwardBatch) -> None:
        if self._split_kv(forward_batch, num_tokens):
            self.prepare_replay(num_tokens, forward_batch)
            return
        buffers = self._graph_buffers
        wrapper = self._decode_wrapper(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=buffers["kv_indptr"][: num_tokens + 1],
            paged_kv_indices_buffer=buffers["kv_indices"],
            paged_kv_last_page_len_buffer=buffers["kv_last_page_len"][:num_tokens],
        )
        self.graph_wrappers[num_tokens] = wrapper
        self.prepare_replay(num_tokens, forward_batch)

    def prepare_replay(self, num_tokens: int, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if self._split_kv(fb, num_tokens):
            _write_index(fb)
            fb.attn_metadata = self._split_kv_metadata(fb)
            return
        wrapper = self.graph_wrappers[num_tokens]
        with self._planning():
            self._plan_decode(wrapper, PagedKVIndex.of(forward_batch), forward_batch.kv_cache)
        forward_batch.attn_metadata = FlashInferMetadata(wrapper)

    def clear_graphs(self) -> None:
        self.graph_wrappers = {}
        self._graph_buffers = {}

    def _split_kv_metadata(self, fb: ForwardBatch) -> SplitKVDecodeMetadata:
        """The split-KV kernel norms q/k on load unless the cache is FP8 with scales the
        host has not seen set (the kernel may set them from the rows, which must be
        normed); XQA and the tensor-core kernel never do."""
        scales = fb.kv_cache.scales
        may_norm = scales is None or (scales.calibrated and self._fp8_kernel(fb.kv_cache) is None)
        return SplitKVDecodeMetadata(fb.block_tables, fb.seq_lens_tensor, may_norm)


def _refuse_mma(why: str | None) -> None:
    """``kernels.fp8_decode: mma`` where the tensor-core kernel cannot run: why not."""
    if why is not None:
        raise ValueError(f"kernels.fp8_decode: mma: {why}; use auto or split_kv")


def _write_index(fb: ForwardBatch) -> None:
    """The padded batch's block tables and lengths into the graph's static buffers
    (``fb.block_tables``, ``fb.seq_lens_tensor``): one copy from the host, which does
    not wait for the device, then two on it."""
    tables = padded_block_tables(fb.block_ids, dtype=np.int32)
    host = np.concatenate([np.asarray(fb.seq_lens, dtype=np.int32)[:, None], tables], axis=1)
    index = torch.from_numpy(host).to(fb.block_tables.device, non_blocking=True)
    fb.seq_lens_tensor.copy_(index[:, 0])
    fb.block_tables[:, : tables.shape[1]].copy_(index[:, 1:])
