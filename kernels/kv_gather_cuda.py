"""KV gather / scatter as one CUDA kernel launch for several layers (cupy + NVRTC).

Same semantics as ``kv_gather.py`` (the reference), plus a ``live`` flag for the
scatter: a one-element int32 device tensor read when each thread block starts;
while it holds 0 the scatter writes nothing. A KV receiver queues its scatters
before the bytes arrive and clears the flag to cancel the ones not yet run.

One thread block moves one token row (heads x head_dim) of one layer's K or V in
16-byte words, with the cache pointers of all layers in a device table: the
launch costs the same for 1 or 36 layers, where the reference launches two index
ops per layer. Rows must be a whole number of 16-byte words (``supports``).

``KVGatherKernel.gather`` / ``scatter`` take tensors and check them per call.
A KV hand-off instead binds its slots and staging buffer once (``bind``) and
launches per layer with a layer range and a byte offset (``KVCopyLaunch``),
straight through the driver with its parameters prebuilt.
"""

from __future__ import annotations

import ctypes
import logging

import torch

try:
    import cupy as _cupy
    from cupy.cuda import driver as _driver
    from cupy.cuda import runtime as _runtime
except ImportError:  # machines without cupy: ``build`` returns None
    _cupy = _driver = _runtime = None

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
        if _cupy is None:
            raise ImportError("the fused KV copy kernels need cupy")
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
        with _cupy.cuda.Device(self.device.index):
            module = _cupy.RawModule(code=_SOURCE)
            self._kernels = {True: module.get_function("kv_gather")}
            self._kernels[False] = module.get_function("kv_scatter")
            # Their CUfunction handles on this device: ``KVCopyLaunch`` calls the driver.
            self._functions = {gather: k.kernel.ptr for gather, k in self._kernels.items()}

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
        self._check_buffer(slots, out)
        self.bind(slots, out, stream).gather(first, out.shape[0])

    def scatter(
        self,
        first: int,
        slots: torch.Tensor,
        kv: torch.Tensor,
        live: torch.Tensor | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """``(K, V)[slots] = kv[j]`` for layer ``first + j``, unless ``live`` holds 0 then."""
        self._check_buffer(slots, kv)
        self.bind(slots, kv, stream, live).scatter(first, kv.shape[0])

    def bind(
        self,
        slots: torch.Tensor,
        staging: torch.Tensor,
        stream: torch.cuda.Stream | None = None,
        live: torch.Tensor | None = None,
    ) -> KVCopyLaunch:
        """Launches between ``slots`` and a flat ``staging`` buffer, checked here once."""
        if slots.dtype != torch.int64 or slots.device != self.device or slots.dim() != 1:
            raise ValueError(f"slots must be 1-D int64 on {self.device}, got {slots.dtype}")
        if not slots.is_contiguous():
            raise ValueError("slots must be contiguous")
        if staging.device != self.device or not staging.is_contiguous():
            raise ValueError(f"the staging buffer must be contiguous on {self.device}")
        if live is not None and (live.dtype != torch.int32 or live.device != self.device):
            raise ValueError(f"live must be an int32 tensor on {self.device}, got {live}")
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        return KVCopyLaunch(self, slots, staging, stream, live)

    def _check_buffer(self, slots: torch.Tensor, buf: torch.Tensor) -> None:
        """``buf`` is exactly ``[layers, 2, tokens, row]`` (the launch checks the layers)."""
        layers = buf.shape[0]
        expected = layers * 2 * slots.numel() * self.words * 16
        nbytes = buf.numel() * buf.element_size()
        if nbytes != expected:
            raise ValueError(
                f"buffer must have {expected} bytes ([{layers}, 2, {slots.numel()}, row]), "
                f"got {tuple(buf.shape)} {buf.dtype}"
            )

    def function(self, gather: bool) -> int:
        """The CUfunction handle of the gather (True) or scatter (False) kernel."""
        return self._functions[gather]


class KVCopyLaunch:
    """Gathers or scatters of one token list, between the cache and one staging buffer.

    Made by ``KVGatherKernel.bind``, which checks the slots, buffer and stream once;
    a launch then takes only a layer range and a byte offset into the buffer. A KV
    hand-off launches once per layer on its hot path, so a launch writes two
    parameters in place and calls the driver (``cuLaunchKernel``): about 4 us of
    host time, half of a cupy kernel call, which packs its arguments each time.
    One thread launches at a time (the parameters are shared).
    """

    def __init__(self, kernel: KVGatherKernel, slots, staging, stream, live) -> None:
        self.kernel = kernel
        self.layer_bytes = 2 * slots.numel() * kernel.words * 16  # K and V of one layer
        self._rows_per_layer = 2 * slots.numel()
        self._staging, self._end = staging.data_ptr(), staging.numel() * staging.element_size()
        self._stream = stream.cuda_stream
        self._block = min(kernel.words, 256)
        self._device = kernel.device.index
        # The kernel's parameters, in place: a launch sets ``first`` and ``buf`` and hands
        # the driver their addresses (it copies the values when the launch is queued).
        self._first, self._buf = ctypes.c_int32(0), ctypes.c_uint64(0)
        values = [
            ctypes.c_uint64(kernel.table.data_ptr()),
            self._first,
            ctypes.c_uint64(slots.data_ptr()),
            ctypes.c_int64(slots.numel()),
            ctypes.c_int32(kernel.words),
            self._buf,
            ctypes.c_uint64(0 if live is None else live.data_ptr()),  # the scatter's only
        ]
        self._values = values  # alive as long as the block that points at them
        self._params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        self._params_at = ctypes.addressof(self._params)

    def gather(self, first: int, layers: int, offset: int = 0) -> None:
        """Layers ``first .. first + layers - 1`` into the buffer from byte ``offset``."""
        self._launch(True, first, layers, offset)

    def scatter(self, first: int, layers: int, offset: int = 0) -> None:
        """The buffer from byte ``offset`` into layers ``first ..``; nothing while the
        bound ``live`` flag holds 0."""
        self._launch(False, first, layers, offset)

    def _launch(self, gather: bool, first: int, layers: int, offset: int) -> None:
        if not 0 <= first <= first + layers <= self.kernel.num_layers:
            raise ValueError(f"layers {first}..{first + layers - 1} of {self.kernel.num_layers}")
        if offset < 0 or offset + layers * self.layer_bytes > self._end:
            raise ValueError(
                f"{layers} layers of {self.layer_bytes} bytes from byte {offset} overrun "
                f"the staging buffer's {self._end} bytes"
            )
        if layers == 0 or self._rows_per_layer == 0:
            return
        self._first.value, self._buf.value = first, self._staging + offset
        grid = layers * self._rows_per_layer
        args = (self.kernel.function(gather), grid, 1, 1, self._block, 1, 1, 0, self._stream)
        if _runtime.getDevice() == self._device:
            _driver.launchKernel(*args, self._params_at, 0)
        else:
            with _cupy.cuda.Device(self._device):
                _driver.launchKernel(*args, self._params_at, 0)
