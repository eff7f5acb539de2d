"""Paged decode attention over an FP8 (e4m3) KV cache on tensor cores, in CUDA C (cupy +
NVRTC); reference: ``decode_attention.py``.

Same arguments and result as the Triton split-KV kernel over an FP8 cache
(``triton/decode_attention.py``), without its ``new_kv`` and ``norm_rope``: the step's
new rows are in the cache already. It exists for the bytes: at 64 requests x 8k the
Triton kernel ran 1.46x the KV bytes' floor on an H200, its V tile gathered from shared
memory one byte at a time (Hopper has no transposing 8-bit ``ldmatrix``) and its
registers spilled; this one keeps every step at 16-bit shared-memory loads.

One warp attends one KV head's query group (up to 16 heads) to one run of a request's
tokens, 16 tokens (a tile) at a time; a block's warps take consecutive KV heads of the
same request and run, so together they read whole pages. Each warp keeps its own ring of
``stages`` tiles in shared memory (``cp.async``, rows swizzled by 16-byte chunks, zeros
past the run) and never waits for another warp.

- ``S = Q K^T`` with Q as the A operand (heads as rows, padded to 16) and K from a plain
  ``ldmatrix``: a lane's four bytes of a K row are the two k-pairs of its B registers
  once the head dim is permuted within each 16-byte chunk; q is loaded in that order.
- ``O^T += V^T P^T`` with V^T as the A operand: a transposing ``ldmatrix`` of byte pairs
  and one byte permute give each lane two tokens of one dim, so the output's dims come
  permuted within each chunk (undone as it is stored); P is the B operand straight from
  the score registers.

Both products run in float16 (e4m3 and bfloat16's 8 bits of q are exact in it, q clamped
to its range) with float32 sums and an online softmax in base 2; K's scale joins the
softmax scale and V's multiplies the output, both read on the device. With several
splits a request the partial outputs and their log-sum-exp go to the Triton kernel's
merge launch (``merge_splits``).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from splitserve.kernels import tuning
from splitserve.kernels.decode_attention import check_shapes
from splitserve.kernels.kv_store import FP8_DTYPE
from splitserve.kernels.triton.decode_attention import MAX_SPLITS, merge_splits
from splitserve.kernels.triton.device import capability, sm_count
from splitserve.kernels.tuning import FP8DecodeTiles

try:
    import cupy as _cupy
    from cupy.cuda import driver as _driver
    from cupy.cuda import runtime as _runtime
except ImportError:  # machines without cupy: ``FP8DecodeKernel.supports`` says why
    _cupy = _driver = _runtime = None

HEAD_DIM = 128  # the chunk swizzle and the fragments are laid out for it
MAX_GROUP = 16  # query heads a KV head: the rows of the first product
TILE = 16  # tokens a warp attends at a time

_SOURCE = r"""
// Defined by the host: G (query heads a KV head), BLOCK_SIZE (tokens a cache block),
// WARPS (KV heads a block), STAGES (tiles in flight a warp), Q_BF16 (q / out bf16, else f16).
#define D 128
#define CHUNKS (D / 16)
#define TILE 16
#define TILE_BYTES (TILE * D)
#define STAGE_BYTES (2 * TILE_BYTES)
#define FULL 0xffffffffu
#define LN2 0.69314718055994530942f
#define NEG_INF __int_as_float(0xff800000)
#define HEAD_TILES ((G + 7) / 8)

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Two e4m3 bytes (low byte first) as two float16 (low half first).
__device__ __forceinline__ u32 f16x2_of_e4m3x2(u32 word, int high) {
    u32 r;
    u16 pair = (u16)(high ? word >> 16 : word & 0xffff);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(pair));
    return r;
}

__device__ __forceinline__ u32 f16x2_of_floats(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 out_pair(float lo, float hi) {  // in q's dtype
#if Q_BF16
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return f16x2_of_floats(lo, hi);
#endif
}

__device__ __forceinline__ float q_float(u16 h) {
#if Q_BF16
    return __uint_as_float(((u32)h) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ u32 permute_bytes(u32 x, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %1, %2;" : "=r"(r) : "r"(x), "r"(selector));
    return r;
}

#define FLOAT_OP(name, ptx)                                        \
    __device__ __forceinline__ float name(float x) {               \
        float r;                                                   \
        asm(ptx " %0, %1;" : "=f"(r) : "f"(x));                    \
        return r;                                                  \
    }
FLOAT_OP(exp2_approx, "ex2.approx.ftz.f32")
FLOAT_OP(log2_approx, "lg2.approx.ftz.f32")

__device__ __forceinline__ void mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(FULL, x, 1));
    return fmaxf(x, __shfl_xor_sync(FULL, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(FULL, x, 1);
    return x + __shfl_xor_sync(FULL, x, 2);
}

// q's A fragments in the permuted dim order: for chunk c a lane holds dims
// 16c + 4(lane % 4) + {0, 1} (a0: head lane / 4, a1: head lane / 4 + 8) and + {2, 3} (a2, a3).
__device__ __forceinline__ void load_q(const u16* q_heads, long long stride_qh, int lane,
                                       u32 (*qa)[4]) {
    #pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            int h = lane / 4 + 8 * r;
            float x[4] = {0.f, 0.f, 0.f, 0.f};
            if (h < G) {
                const u16* p = q_heads + h * stride_qh + 16 * c + 4 * (lane & 3);
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    x[e] = fminf(fmaxf(q_float(p[e]), -65504.f), 65504.f);
            }
            qa[c][r] = f16x2_of_floats(x[0], x[1]);
            qa[c][2 + r] = f16x2_of_floats(x[2], x[3]);
        }
    }
}

// One tile's scores: s[j] is the product for tokens 8j .. 8j + 7 (C fragments: a lane holds
// head lane / 4, tokens 8j + 2(lane % 4) + {0, 1} in s[j][0..1], head + 8 in s[j][2..3]).
__device__ __forceinline__ void tile_scores(u32 k_tile, const u32* at, const u32 (*qa)[4],
                                            float (*s)[4]) {
    #pragma unroll
    for (int p = 0; p < CHUNKS / 2; ++p) {
        u32 r[4];  // tokens 0-7 / 8-15 of chunk 2p, then of chunk 2p + 1
        ldsm_x4(k_tile + at[p], r);
        #pragma unroll
        for (int m = 0; m < 4; ++m)
            mma_f16(s[m & 1], qa[2 * p + (m >> 1)], f16x2_of_e4m3x2(r[m], 0),
                    f16x2_of_e4m3x2(r[m], 1));
    }
}

// o[t][c] += V^T P^T for chunk c's 16 dims (rows: dims 16c + 2(lane / 4), then + 1) and
// heads 8t + 2(lane % 4) + {0, 1}; p[t] are the B fragments of the tile's probabilities.
__device__ __forceinline__ void tile_values(u32 v_tile, const u32* at, const u32 (*p)[2],
                                            float (*o)[CHUNKS][4]) {
    #pragma unroll
    for (int pc = 0; pc < CHUNKS / 2; ++pc) {
        u32 r[4];  // per lane: tokens 2(lane % 4) + {0, 1} x dims 2(lane / 4) + {0, 1}
        ldsm_x4_trans(v_tile + at[pc], r);
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            // bytes (t, d) (t, d+1) (t+1, d) (t+1, d+1) -> (t, d) (t+1, d) (t, d+1) (t+1, d+1)
            u32 lo = permute_bytes(r[2 * half], 0x3120u);
            u32 hi = permute_bytes(r[2 * half + 1], 0x3120u);
            u32 a[4] = {f16x2_of_e4m3x2(lo, 0), f16x2_of_e4m3x2(lo, 1),
                        f16x2_of_e4m3x2(hi, 0), f16x2_of_e4m3x2(hi, 1)};
            #pragma unroll
            for (int t = 0; t < HEAD_TILES; ++t)
                mma_f16(o[t][2 * pc + half], a, p[t][0], p[t][1]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
fp8_decode(const u16* __restrict__ q, long long stride_qb, long long stride_qh,
           const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
           long long stride_block, long long stride_token,
           const int* __restrict__ tables, long long stride_table, int table_step,
           const int* __restrict__ seq_lens, int len_step,
           const float* __restrict__ k_scale, const float* __restrict__ v_scale,
           float softmax_scale,
           u16* __restrict__ out, long long stride_ob, long long stride_oh,
           float* __restrict__ part_out, float* __restrict__ part_lse, int splits,
           int num_heads) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kv_head = blockIdx.x * WARPS + warp;
    const int split = blockIdx.y;
    const long long b = blockIdx.z;
    const int seq_len = seq_lens[b * len_step];
    const int run = ((seq_len + splits - 1) / splits + TILE - 1) / TILE * TILE;
    const int start = split * run;
    const int end = min(start + run, seq_len);
    const int tiles = end > start ? (end - start + TILE - 1) / TILE : 0;
    const int* table = tables + b * stride_table;
    const int head0 = kv_head * G;
    const float scale = softmax_scale * *k_scale * 1.4426950408889634f;  // base 2

    u32 qa[CHUNKS][4];
    load_q(q + b * stride_qb + head0 * stride_qh, stride_qh, lane, qa);

    // Where this lane's parts of a tile go, computed once: its four 16-byte chunks of the
    // tile's rows (offsets from the tile's first row in the cache and in a ring slot),
    // and the rows its ldmatrix loads address (offsets in a slot, one a pair of chunks).
    int rows[TILE * CHUNKS / 32], src[TILE * CHUNKS / 32];
    u32 dst[TILE * CHUNKS / 32], at[CHUNKS / 2];
    #pragma unroll
    for (int j = 0; j < TILE * CHUNKS / 32; ++j) {
        const int c = lane + 32 * j, chunk = c % CHUNKS;
        rows[j] = c / CHUNKS;
        src[j] = rows[j] * (int)stride_token + 16 * chunk;
        dst[j] = rows[j] * D + ((chunk ^ (rows[j] & 7)) << 4);
    }
    #pragma unroll
    for (int p = 0; p < CHUNKS / 2; ++p) {
        const int row = ((lane >> 3) & 1) * 8 + (lane & 7), chunk = 2 * p + (lane >> 4);
        at[p] = row * D + ((chunk ^ (row & 7)) << 4);
    }

    const u32 ring = smem_u32(smem) + warp * STAGES * STAGE_BYTES;
    int blocks = 0;  // lane j: the cache block of tile 32 * (i / 32) + j
    auto issue = [&](int i, int slot) {  // tile i's K and V rows into a slot of the ring
        if (i < tiles) {
            if ((i & 31) == 0) {
                const int t = i + lane;
                blocks = t < tiles ? table[((start + TILE * t) / BLOCK_SIZE) * table_step] : 0;
            }
            const int block = __shfl_sync(FULL, blocks, i & 31);
            const int first = start + TILE * i;
            const long long base = (long long)block * stride_block +
                                   (long long)(first % BLOCK_SIZE) * stride_token + kv_head * D;
            const unsigned char* k_rows = k_cache + base;
            const unsigned char* v_rows = v_cache + base;
            const u32 to = ring + slot * STAGE_BYTES;
            #pragma unroll
            for (int j = 0; j < TILE * CHUNKS / 32; ++j) {
                const bool live = rows[j] < end - first;  // zeros past the run
                const int from = live ? src[j] : 0;
                cp_async16(to + dst[j], k_rows + from, live ? 16 : 0);
                cp_async16(to + dst[j] + TILE_BYTES, v_rows + from, live ? 16 : 0);
            }
        }
        cp_async_commit();
    };

    float m[2] = {NEG_INF, NEG_INF};  // running max (base 2) of head lane/4, lane/4 + 8
    float l[2] = {0.f, 0.f};              // this lane's part of their running sums
    float o[HEAD_TILES][CHUNKS][4];
    #pragma unroll
    for (int t = 0; t < HEAD_TILES; ++t)
        #pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
            #pragma unroll
            for (int e = 0; e < 4; ++e) o[t][c][e] = 0.f;

    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) issue(i, i);
    int slot = 0;  // tile i's, i % STAGES; the next issue's is the one before it
    for (int i = 0; i < tiles; ++i) {
        __syncwarp();  // every lane is done with the slot the next issue overwrites
        issue(i + STAGES - 1, slot == 0 ? STAGES - 1 : slot - 1);
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const u32 k_tile = ring + slot * STAGE_BYTES;
        slot = slot + 1 == STAGES ? 0 : slot + 1;
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        tile_scores(k_tile, at, qa, s);

        const int first = start + TILE * i + 2 * (lane & 3);
        float top[2] = {NEG_INF, NEG_INF};
        bool grows = false;
        #pragma unroll
        for (int r = 0; r < HEAD_TILES; ++r) {
            #pragma unroll
            for (int j = 0; j < 2; ++j)
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = first + 8 * j + e < end ? s[j][2 * r + e] * scale : NEG_INF;
                    s[j][2 * r + e] = x;
                    top[r] = fmaxf(top[r], x);
                }
            top[r] = quad_max(top[r]);
            grows |= top[r] > m[r];
        }
        if (__any_sync(FULL, grows)) {  // a running max grew: rescale (rarely after a few tiles)
            #pragma unroll
            for (int r = 0; r < HEAD_TILES; ++r) {
                const float m_new = fmaxf(m[r], top[r]);
                const float alpha = exp2_approx(m[r] - m_new);
                m[r] = m_new;
                l[r] *= alpha;
                // the output rows' heads 8r + 2(lane % 4) + {0, 1}: their factors from lanes 4h
                const float a_lo = __shfl_sync(FULL, alpha, 8 * (lane & 3));
                const float a_hi = __shfl_sync(FULL, alpha, 8 * (lane & 3) + 4);
                #pragma unroll
                for (int c = 0; c < CHUNKS; ++c) {
                    o[r][c][0] *= a_lo;
                    o[r][c][1] *= a_hi;
                    o[r][c][2] *= a_lo;
                    o[r][c][3] *= a_hi;
                }
            }
        }
        u32 p[HEAD_TILES][2];
        #pragma unroll
        for (int r = 0; r < HEAD_TILES; ++r) {
            #pragma unroll
            for (int j = 0; j < 2; ++j)
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    s[j][2 * r + e] = exp2_approx(s[j][2 * r + e] - m[r]);
                    l[r] += s[j][2 * r + e];
                }
            p[r][0] = f16x2_of_floats(s[0][2 * r], s[0][2 * r + 1]);
            p[r][1] = f16x2_of_floats(s[1][2 * r], s[1][2 * r + 1]);
        }
        tile_values(k_tile + TILE_BYTES, at, p, o);
    }
    cp_async_wait<0>();

    const float v = *v_scale;
    #pragma unroll
    for (int t = 0; t < HEAD_TILES; ++t) {
        const float total = quad_sum(l[t]);
        if ((lane & 3) == 0 && splits > 1 && lane / 4 + 8 * t < G) {
            const long long row = (b * num_heads + head0 + lane / 4 + 8 * t) * splits + split;
            part_lse[row] = total > 0.f ? (m[t] + log2_approx(total)) * LN2 : NEG_INF;
        }
        #pragma unroll
        for (int e = 0; e < 2; ++e) {  // heads 8t + 2(lane % 4) + e
            const int h = 8 * t + 2 * (lane & 3) + e;
            const float sum = __shfl_sync(FULL, total, 8 * (lane & 3) + 4 * e);
            if (h >= G) continue;
            const float f = sum > 0.f ? v / sum : 0.f;
            #pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int d = 16 * c + 2 * (lane >> 2);  // dims d and d + 1
                const float x0 = o[t][c][e] * f, x1 = o[t][c][2 + e] * f;
                if (splits == 1) {
                    u16* dst = out + b * stride_ob + (head0 + h) * stride_oh + d;
                    *reinterpret_cast<u32*>(dst) = out_pair(x0, x1);
                } else {
                    const long long row = (b * num_heads + head0 + h) * splits + split;
                    *reinterpret_cast<float2*>(part_out + row * D + d) = make_float2(x0, x1);
                }
            }
        }
    }
}
"""


@functools.cache
def _compile(
    device: int, group: int, block_size: int, bf16: bool, warps: int, stages: int
) -> object:
    """The kernel for one shape and tiling on one GPU (NVRTC, once a process)."""
    defines = {
        "G": group, "BLOCK_SIZE": block_size, "WARPS": warps, "STAGES": stages,
        "Q_BF16": int(bf16),
    }  # fmt: skip
    options = tuple(f"-D{k}={v}" for k, v in defines.items()) + ("--std=c++17",)
    with _cupy.cuda.Device(device):
        kernel = _cupy.RawModule(code=_SOURCE, options=options).get_function("fp8_decode")
        kernel.max_dynamic_shared_size_bytes = warps * stages * 2 * TILE * HEAD_DIM
    return kernel


class FP8DecodeKernel:
    """The tensor-core FP8 decode kernel at one tiling (default: the tuning table's).

    ``supports`` says whether it runs on a device and cache; a call checks its tensors as
    the Triton kernel does and runs on the current torch stream (a CUDA graph captures it:
    the grid depends on the batch size only)."""

    def __init__(self, tiles: FP8DecodeTiles | None = None):
        self.tiles = tiles

    @staticmethod
    def supports(device: torch.device, head_dim: int, group: int, block_size: int) -> str | None:
        """None where the kernel runs, else why not (a sentence)."""
        if _cupy is None:
            return "the FP8 tensor-core decode kernel is compiled with cupy, not installed here"
        if device.type != "cuda" or capability(device) < (8, 9):
            return "the FP8 tensor-core decode kernel needs an sm89+ GPU (FP8 conversions)"
        if head_dim != HEAD_DIM or not 1 <= group <= MAX_GROUP or block_size % TILE:
            return (
                f"the FP8 tensor-core decode kernel takes head_dim {HEAD_DIM}, up to "
                f"{MAX_GROUP} query heads a KV head and blocks of a multiple of {TILE} tokens; "
                f"got head_dim {head_dim}, group {group}, block_size {block_size}"
            )
        return None

    @staticmethod
    def num_splits(tiles: FP8DecodeTiles, batch: int, num_kv_heads: int, num_sms: int) -> int:
        """Splits a request: about ``tiles.blocks_per_sm`` blocks an SM, a power of 2 up to
        32 (from the batch size alone: graph-static)."""
        blocks = batch * (num_kv_heads // math.gcd(tiles.warps, num_kv_heads))
        want = max(math.ceil(tiles.blocks_per_sm * num_sms / max(blocks, 1)), 1)
        return min(MAX_SPLITS, 1 << (want - 1).bit_length())

    def __call__(
        self,
        q: torch.Tensor,  # [batch, num_heads, head_dim] bf16 / f16
        k_cache: torch.Tensor,  # NHD [num_blocks, block_size, num_kv_heads, head_dim] FP8
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [batch, max_blocks] int32 or int64
        seq_lens: torch.Tensor,  # [batch] int32 or int64, the new token's row included
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor],  # [1] float32 K and V scales
        splits: int | None = None,  # default: ``num_splits`` for this device
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_shapes(q, k_cache, v_cache, block_tables, seq_lens, kv_scales=kv_scales)
        batch, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        group = num_heads // num_kv_heads
        why = self.supports(q.device, head_dim, group, block_size)
        if why is not None:
            raise ValueError(why)
        self._check_layout(q, k_cache, v_cache, block_tables, seq_lens, out)
        tiles = self.tiles or tuning.for_device(q.device).fp8_decode_tiles
        warps = math.gcd(tiles.warps, num_kv_heads)
        if splits is None:
            splits = self.num_splits(tiles, batch, num_kv_heads, sm_count(q.device, off_gpu=1))
        out = torch.empty_like(q) if out is None else out
        if batch == 0:
            return out
        part_out = part_lse = out
        if splits > 1:
            f32 = {"dtype": torch.float32, "device": q.device}
            part_out = torch.empty(batch, num_heads, splits, head_dim, **f32)
            part_lse = torch.empty(batch, num_heads, splits, **f32)
        kernel = _compile(
            q.device.index, group, block_size, q.dtype == torch.bfloat16, warps, tiles.stages
        )
        table_step = 2 if block_tables.dtype == torch.int64 else 1  # low int32 words
        u64, i64, i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32
        values = [
            u64(q.data_ptr()), i64(q.stride(0)), i64(q.stride(1)),
            u64(k_cache.data_ptr()), u64(v_cache.data_ptr()),
            i64(k_cache.stride(0)), i64(k_cache.stride(1)),
            u64(block_tables.data_ptr()), i64(block_tables.stride(0) * table_step),
            i32(table_step), u64(seq_lens.data_ptr()),
            i32(2 if seq_lens.dtype == torch.int64 else 1),
            u64(kv_scales[0].data_ptr()), u64(kv_scales[1].data_ptr()), ctypes.c_float(scale),
            u64(out.data_ptr()), i64(out.stride(0)), i64(out.stride(1)),
            u64(part_out.data_ptr()), u64(part_lse.data_ptr()), i32(splits), i32(num_heads),
        ]  # fmt: skip
        params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        launch = (
            kernel.kernel.ptr, num_kv_heads // warps, splits, batch, 32 * warps, 1, 1,
            warps * tiles.stages * 2 * TILE * head_dim,
            torch.cuda.current_stream(q.device).cuda_stream, ctypes.addressof(params), 0,
        )  # fmt: skip
        if _runtime.getDevice() == q.device.index:
            _driver.launchKernel(*launch)
        else:
            with _cupy.cuda.Device(q.device.index):
                _driver.launchKernel(*launch)
        if splits > 1:
            merge_splits(part_out, part_lse, out)
        return out

    @staticmethod
    def _check_layout(q, k_cache, v_cache, block_tables, seq_lens, out) -> None:
        if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != FP8_DTYPE:
            raise ValueError(
                f"the FP8 tensor-core decode kernel reads bf16 / f16 q over a {FP8_DTYPE} "
                f"cache; got q {q.dtype}, cache {k_cache.dtype}"
            )
        if q.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError("q and the caches need a contiguous head_dim and equal cache strides")
        if k_cache.stride(2) != k_cache.shape[-1] or block_tables.stride(-1) != 1:
            raise ValueError("the caches' heads and the block tables' rows must be contiguous")
        if seq_lens.stride(0) != 1 or (
            out is not None and (out.stride(-1) != 1 or out.stride(1) % 2)
        ):
            raise ValueError("the lengths must be contiguous, out's rows too (an even head stride)")
        if block_tables.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (
            torch.int32,
            torch.int64,
        ):
            raise ValueError("block tables and lengths are int32 or int64")
