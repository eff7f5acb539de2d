"""KV gather / scatter as one CUDA kernel launch for several layers (cupy + NVRTC).

Same semantics as ``kv_gather.py`` (the reference), plus a ``live`` flag for the
scatter: a one-element int32 device tensor read when each thread block starts;
while it holds 0 the scatter writes nothing. A KV receiver queues its scatters
before the bytes arrive and clears the flag to cancel the ones not yet run.

One thread block moves one token row (heads x head_dim) of one layer's K or V in
16-byte words, with the cache pointers of all layers in a device table: the
launch costs the same for 1 or 36 layers, where the reference launches two index
ops per layer. Rows must be a whole number of 16-byte words (``supports``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
// buf is [layers, 2, tokens, row] (K then V of each layer); table holds the K and V
// cache pointers of every layer (K0, V0, K1, V1, ...). Row (j, kv, t) of buf is the
// row at slots[t] of layer first + j. One block moves one row, in 16-byte words.
__device__ __forceinline__ void kv_rows(bool to_buf, unsigned long long table, int first,
        unsigned long long slots, long long tokens, int words, unsigned long long buf,
        unsigned long long live) {
    if (live != 0 && *reinterpret_cast<volatile const int*>(live) == 0) return;
    long long row = blockIdx.x;
    long long t = row % tokens;
    long long jkv = row / tokens;
    ulonglong2* cache = reinterpret_cast<ulonglong2*>(
        reinterpret_cast<const long long*>(table)[2 * first + jkv]);
    cache += reinterpret_cast<const long long*>(slots)[t] * words;
    ulonglong2* rows = reinterpret_cast<ulonglong2*>(buf) + row * words;
    for (int w = threadIdx.x; w < words; w += blockDim.x) {
        if (to_buf) rows[w] = cache[w]; else cache[w] = rows[w];
    }
}

extern "C" __global__ void kv_gather(unsigned long long table, int first,
        unsigned long long slots, long long tokens, int words, unsigned long long buf) {
    kv_rows(true, table, first, slots, tokens, words, buf, 0);
}

extern "C" __global__ void kv_scatter(unsigned long long table, int first,
        unsigned long long slots, long long tokens, int words, unsigned long long buf,
        unsigned long long live) {
    kv_rows(false, table, first, slots, tokens, words, buf, live);
}
"""


class KVGatherKernel:
    """The compiled kernels for one KV cache (its layers' K and V tensors).

    Build once per cache (``build`` returns None where cupy or NVRTC is missing);
    ``gather`` and ``scatter`` run on the current torch stream of the cache's device.
    """

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        import cupy

        if not k_caches[0].is_cuda:
            raise ValueError(f"the KV cache is on {k_caches[0].device}, not a GPU")
        if not self.supports(k_caches):
            k0 = k_caches[0]
            raise ValueError(
                f"KV rows of {k0.shape[-2]} x {k0.shape[-1]} {k0.dtype} are not a multiple "
                "of 16 bytes"
            )
        k0 = k_caches[0]
        self.device = k0.device
        self.words = k0.shape[-2] * k0.shape[-1] * k0.element_size() // 16
        self.num_layers = len(k_caches)
        ptrs = [t.data_ptr() for kv in zip(k_caches, v_caches) for t in kv]
        self.table = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        with cupy.cuda.Device(self.device.index):
            module = cupy.RawModule(code=_SOURCE)
            self._kernels = {True: module.get_function("kv_gather")}
            self._kernels[False] = module.get_function("kv_scatter")
        self._streams: dict[int, object] = {}  # cupy views of torch streams, by handle

    @staticmethod
    def supports(k_caches: list[torch.Tensor]) -> bool:
        k0 = k_caches[0]
        return k0.is_cuda and k0.shape[-2] * k0.shape[-1] * k0.element_size() % 16 == 0

    @classmethod
    def build(
        cls, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
    ) -> KVGatherKernel | None:
        """The kernels, or None (logged with the reason) where they cannot be built here."""
        try:
            return cls(k_caches, v_caches)
        except Exception as e:  # no cupy, no NVRTC, an odd row size
            logger.warning("fused KV gather kernel unavailable: %s: %s", type(e).__name__, e)
            return None

    def gather(
        self,
        first: int,
        slots: torch.Tensor,
        out: torch.Tensor,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """``out[j] = (K, V)[slots]`` of layer ``first + j``, on ``stream`` (default: the
        current stream)."""
        self._launch(True, first, slots, out, 0, stream)

    def scatter(
        self,
        first: int,
        slots: torch.Tensor,
        kv: torch.Tensor,
        live: torch.Tensor | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """``(K, V)[slots] = kv[j]`` for layer ``first + j``, unless ``live`` holds 0 then."""
        if live is not None and (live.dtype != torch.int32 or live.device != self.device):
            raise ValueError(f"live must be an int32 tensor on {self.device}, got {live}")
        self._launch(False, first, slots, kv, 0 if live is None else live.data_ptr(), stream)

    def _launch(self, gather: bool, first: int, slots, buf, live: int, stream) -> None:
        # A transfer launches this once per message on its hot path: the stream and the
        # device are passed, not entered as contexts.
        import cupy
        import numpy

        self._check(first, slots, buf)
        rows = buf.shape[0] * 2 * slots.numel()
        if rows == 0:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        handle = stream.cuda_stream
        cupy_stream = self._streams.get(handle)
        if cupy_stream is None:
            cupy_stream = self._streams[handle] = cupy.cuda.ExternalStream(handle)
        args = (
            numpy.uint64(self.table.data_ptr()),
            numpy.int32(first),
            numpy.uint64(slots.data_ptr()),
            numpy.int64(slots.numel()),
            numpy.int32(self.words),
            numpy.uint64(buf.data_ptr()),
        )
        if not gather:
            args += (numpy.uint64(live),)
        kernel, block = self._kernels[gather], (min(self.words, 256),)
        if cupy.cuda.runtime.getDevice() == self.device.index:
            kernel((rows,), block, args, stream=cupy_stream)
        else:
            with cupy.cuda.Device(self.device.index):
                kernel((rows,), block, args, stream=cupy_stream)

    def _check(self, first: int, slots: torch.Tensor, buf: torch.Tensor) -> None:
        layers = buf.shape[0]
        if not 0 <= first <= first + layers <= self.num_layers:
            raise ValueError(f"layers {first}..{first + layers - 1} of {self.num_layers}")
        if slots.dtype != torch.int64 or slots.device != self.device or slots.dim() != 1:
            raise ValueError(f"slots must be 1-D int64 on {self.device}, got {slots.dtype}")
        expected = layers * 2 * slots.numel() * self.words * 16
        nbytes = buf.numel() * buf.element_size()
        if buf.device != self.device or not buf.is_contiguous() or nbytes != expected:
            raise ValueError(
                f"buffer must be contiguous on {self.device} with {expected} bytes "
                f"([{layers}, 2, {slots.numel()}, row]), got {tuple(buf.shape)} {buf.dtype} "
                f"on {buf.device}"
            )
        if not slots.is_contiguous():
            raise ValueError("slots must be contiguous")
