"""Every engine setting, defined once.

``EngineConfig`` is what ``LLM(...)``, the CLI and YAML deployment configs
build. Unknown keys are errors that name the key and list the accepted ones.
Environment variables are read here and nowhere else (see ``ENV_VARS``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEVICES = ("cpu", "cuda")
# cache.kv_cache_dtype -> the KV cache's element type; auto: the model's dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}

# name -> (meaning, default). The only environment variables splitserve reads.
ENV_VARS: dict[str, tuple[str, str]] = {
    "SPLITSERVE_DEVICE": ("default device when none is given: cpu or cuda", ""),
    "SPLITSERVE_LOG_LEVEL": ("logging level of the splitserve loggers", "INFO"),
    "SPLITSERVE_PDL": (
        "programmatic dependent launch between the Triton kernels on sm90+: 1 on, 0 off",
        "1",
    ),
    "SPLITSERVE_API_KEY": (
        "the key clients of `splitserve serve` must send as `Authorization: Bearer <key>` "
        "(`--api-key` takes precedence; this over `http.api_key`); empty: no key",
        "",
    ),
    "SPLITSERVE_WARMUP": (
        "the engine's start-up run of its eager forwards (prompts, a wide decode, the MTP "
        "drafter): auto (on a GPU), 1 (on any device: tests run it on CPU), 0 (off: a "
        "faster start; the first requests compile what they meet)",
        "auto",
    ),
    # Fault injection, for tests that kill a worker in a given phase of a request.
    "SPLITSERVE_PREFILL_STEP_DELAY_S": (
        "fault injection for tests: an engine sleeps this long after each step that leaves a "
        "prompt partly computed, so a long prompt stays mid-prefill; 0: off",
        "0",
    ),
    "SPLITSERVE_KV_LAYER_DELAY_S": (
        "fault injection for tests: a KV sender waits this long after each layer frame it "
        "writes (CPU transport), so a hand-off stays mid-transfer; 0: off",
        "0",
    ),
}


def env(name: str) -> str:
    if name not in ENV_VARS:
        raise KeyError(
            f"unknown splitserve environment variable {name!r}; known: {sorted(ENV_VARS)}"
        )
    return os.environ.get(name, ENV_VARS[name][1])


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; accepted: {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | None) -> torch.device:
    device = device or env("SPLITSERVE_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = device.split(":")[0]
    if kind not in DEVICES:
        raise ValueError(f"unknown device {device!r}; accepted: {', '.join(DEVICES)}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for, but torch sees no CUDA GPU; use --device cpu"
        )
    return torch.device(device)


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 0.5  # used when num_kv_blocks is None
    enable_prefix_caching: bool = True
    # auto: the model's dtype; fp8_e4m3: float8_e4m3fn with a K and a V scale a layer
    # (half of bf16's bytes: twice the blocks from kv_cache_memory_gb)
    kv_cache_dtype: str = "auto"

    def check(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"invalid cache.kv_cache_dtype={self.kv_cache_dtype!r}: must be one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"invalid block_size={self.block_size}: must be a power of two >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"invalid num_kv_blocks={self.num_kv_blocks}: must be >= 2")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"invalid kv_cache_memory_gb={self.kv_cache_memory_gb}: must be > 0")

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type for a model computing in ``model_dtype``."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # cap on running requests
    max_num_batched_tokens: int = 2048  # per-step token budget
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Schedule and prepare step i + 1 while the device computes step i (the host
    # reads step i's tokens after queueing step i + 1). None: on for CUDA devices.
    async_scheduling: bool | None = None
    # A stream's new tokens go out every this many tokens (its first and its last at
    # once): fewer, larger messages and SSE events per stream, less host time per token,
    # at the cost of smoothness. 1: each token as it is sampled. Whole outputs
    # (``LLM.generate``, non-streaming responses) are the same either way.
    stream_interval: int = 1

    def check(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"invalid max_num_seqs={self.max_num_seqs}: must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"invalid max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"invalid max_model_len={self.max_model_len}: must be >= 1")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(
                f"invalid async_scheduling={self.async_scheduling!r}: must be true, false or "
                "null (on for CUDA devices)"
            )
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(
                f"invalid stream_interval={self.stream_interval!r}: must be an integer >= 1 "
                "(1: each token as it is sampled)"
            )


@dataclass
class CudaGraphConfig:
    """CUDA graphs on a GPU (ignored on CPU). Sizes are in tokens per step.

    Decode graphs capture a whole decode step per size (``batch * (1 +
    draft tokens)``); prefill and mixed steps up to the largest
    ``prefill_sizes`` entry replay piecewise graphs (the forward between
    attention calls) with attention run eagerly. ``enabled: false`` runs every
    step eagerly (vLLM's ``enforce_eager``).
    """

    enabled: bool = True
    decode_sizes: list[int] | None = None  # None: 1, 2, 4, 8, then every 16 up to max_num_seqs
    prefill_sizes: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256])
    piecewise: bool = True  # piecewise graphs for prefill and mixed steps

    def check(self) -> None:
        for key in ("decode_sizes", "prefill_sizes"):
            sizes = getattr(self, key)
            if sizes is not None and (not sizes or any(int(n) < 1 for n in sizes)):
                raise ValueError(
                    f"invalid cuda_graph.{key}={sizes}: must be a non-empty list of sizes >= 1"
                )

    def decode_capture_sizes(self, max_num_seqs: int) -> list[int]:
        if self.decode_sizes is not None:
            return sorted({int(n) for n in self.decode_sizes})
        sizes = [n for n in (1, 2, 4, 8) if n <= max_num_seqs]
        sizes += list(range(16, max_num_seqs + 1, 16))
        if sizes[-1] != max_num_seqs:
            sizes.append(max_num_seqs)
        return sizes


FP8_DECODE_KERNELS = ("auto", "mma", "split_kv", "xqa")


@dataclass
class KernelConfig:
    """Which GPU kernels a step runs where more than one would do (ignored on CPU).

    Each default is the choice the benchmarks measured best; a benchmark sets a key
    to compare the alternatives (``docs/perf/TUNING.md``).
    """

    # Decode steps of up to this many requests run the Triton split-KV attention
    # kernel (FlashInfer backend); 0: FlashInfer's decode kernels for every batch.
    split_kv_max_batch: int = 64
    # Those decode steps over an FP8 KV cache: "mma" (the CUDA tensor-core kernel,
    # ``kernels/fp8_decode_cuda.py``: sm89+, head_dim 128, up to 16 query heads a KV head;
    # 1.04x its floor against the Triton kernel's 1.14x at 64 x 8k on an H100, the kernel
    # alone, 1.21x against 1.24x in the engine's graphs), "split_kv" (the Triton kernel,
    # tiles widened to float16 too), "xqa" (TensorRT-LLM's XQA through FlashInfer, Hopper
    # only: q and the probabilities rounded to e4m3, 7-8x the error), or "auto" (the
    # default): "mma" where it runs, else "split_kv" (docs/perf/TUNING.md).
    fp8_decode: str = "auto"

    def check(self) -> None:
        value = self.split_kv_max_batch
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"invalid kernels.split_kv_max_batch={value!r}: must be an integer >= 0 "
                "(0: FlashInfer decodes every batch)"
            )
        if self.fp8_decode not in FP8_DECODE_KERNELS:
            raise ValueError(
                f"invalid kernels.fp8_decode={self.fp8_decode!r}: must be one of "
                f"{', '.join(FP8_DECODE_KERNELS)}"
            )


SPEC_METHODS = ("mtp",)


@dataclass
class SpeculativeConfig:
    """Speculative decoding, in vLLM's spelling: ``{method: mtp, num_speculative_tokens: K}``.

    ``mtp``: the checkpoint's MTP layer drafts ``K`` tokens a step (chained, the one
    layer reused), the target verifies them in one step of ``1 + K`` tokens a request.

    ``simulated_acceptance`` (benchmarks of dummy weights only, whose drafter is almost
    never right): at verification each draft becomes the target's own greedy token with
    this probability; the forwards still run on the drafter's tokens, at full cost. The
    emitted tokens then differ from the model's; the engine logs a warning at start.
    """

    method: str = "mtp"
    num_speculative_tokens: int = 1
    simulated_acceptance: float | None = None

    def check(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"invalid speculative_config.method={self.method!r}: "
                f"must be one of {', '.join(SPEC_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"invalid speculative_config.num_speculative_tokens={k!r}: must be an integer "
                ">= 1 (leave speculative_config out to decode without speculation)"
            )
        alpha = self.simulated_acceptance
        if alpha is not None and not (
            isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 <= alpha <= 1
        ):
            raise ValueError(
                f"invalid speculative_config.simulated_acceptance={alpha!r}: must be a number "
                "in [0, 1] (benchmarks only), or left out"
            )


@dataclass
class RequestLimits:
    """How large a request's lists may be: each one costs the engine per step, so a request
    cannot slow down its neighbours (the ingress and ``LLMEngine.add_request`` check them)."""

    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_bad_words: int = 1024

    def check(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"invalid limits.{f.name}={value!r}: must be an integer >= 1")


def speculative_config_from_json(text: str) -> dict[str, Any]:
    """``--speculative-config``'s JSON object (checked by ``EngineConfig``), e.g.
    ``'{"method": "mtp", "num_speculative_tokens": 2}'``."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(
            f"--speculative-config must be a JSON object like "
            f'{{"method": "mtp", "num_speculative_tokens": 2}}, got {text!r}'
        )
    return value


ROLES = ("mixed", "prefill", "decode")
KV_TRANSPORTS = ("auto", "cpu", "nccl")


@dataclass
class KVTransferConfig:
    transport: str = "auto"  # auto (nccl on a GPU, else cpu) | cpu | nccl
    host: str = "127.0.0.1"  # address this worker's transport listens on
    timeout_s: float = 60.0  # a hand-off not finished by then fails and frees its blocks
    # NCCL only (a sender's settings; its receivers follow them): a transfer's messages
    # grow first_message_layers, twice that, ... up to layers_per_message layers and
    # shrink the same way; a message holds at most max_message_mb MiB (None: no limit)
    # unless one layer is larger, which bounds both sides' staging buffers (two of the
    # largest messages each) for long prompts; a pair of workers has `lanes`
    # communicators, the messages alternating between them.
    layers_per_message: int = 8
    first_message_layers: int = 1
    lanes: int = 2
    max_message_mb: int | None = 128
    # Thread blocks an NCCL kernel of the worker's process may take (NCCL_MAX_CTAS, unless
    # the environment sets it; NCCL reads it once a process). A receive is queued when its
    # prompt's prefill starts and holds its blocks on the decode GPU's SMs until the bytes
    # come; a cap leaves the decode step more SMs and the hand-off less bandwidth
    # (``nccl_pair.cap_ctas``). None: NCCL's own count (32 a peer over NVLink).
    max_ctas: int | None = None
    # The shared secret every control-plane connection proves it knows (an HMAC
    # challenge, ``workers/kv/transfer/auth.py``). None: a key drawn once per process,
    # enough for engines in one process; ``splitserve serve`` draws one per application.
    auth_key: str | None = None

    def check(self) -> None:
        if self.transport not in KV_TRANSPORTS:
            raise ValueError(
                f"invalid kv_transfer.transport={self.transport!r}: "
                f"must be one of {', '.join(KV_TRANSPORTS)}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"invalid kv_transfer.timeout_s={self.timeout_s}: must be > 0")
        keys = ("layers_per_message", "first_message_layers", "lanes", "max_message_mb", "max_ctas")
        for key in keys:
            value = getattr(self, key)
            if key in ("max_message_mb", "max_ctas") and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"invalid kv_transfer.{key}={value!r}: must be an integer >= 1")
        if self.auth_key is not None and (not isinstance(self.auth_key, str) or not self.auth_key):
            raise ValueError("invalid kv_transfer.auth_key: must be a non-empty string or null")

    def nccl_options(self) -> dict[str, int | None]:
        """The NCCL transport's keyword arguments."""
        mb = self.max_message_mb
        return {
            "layers_per_message": self.layers_per_message,
            "first_message_layers": self.first_message_layers,
            "lanes": self.lanes,
            "max_message_bytes": None if mb is None else mb << 20,
            "max_ctas": self.max_ctas,
        }


@dataclass
class ParallelConfig:
    """How many devices one engine spans (``workers/parallel``).

    ``expert_parallel_size: N``: the engine is an expert-parallel group of N ranks, each
    a process (on a GPU, each its own device, from the engine's device on): attention
    data-parallel (each rank schedules its own requests and owns its KV cache), a MoE
    model's routed experts sharded E/N a rank, everything else replicated. The number of
    routed experts must be a multiple of N, and on a GPU the host must have the N GPUs.
    """

    expert_parallel_size: int = 1

    def check(self) -> None:
        n = self.expert_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(
                f"invalid parallel.expert_parallel_size={n!r}: must be an integer >= 1 "
                "(1: the whole model on one device)"
            )


@dataclass
class EngineConfig:
    model: str = "qwen3-tiny"  # a directory with a HF checkpoint, or a preset name
    dtype: str = "float32"
    device: str | None = None  # None: cuda when available, else cpu
    seed: int = 0  # seed of random-init presets and of unseeded sampling
    # auto: the checkpoint's weights (presets: portable seeded init); dummy: random
    # weights drawn on the device, fast, for benchmarks of full-size shapes.
    load_format: str = "auto"
    attention_backend: str = "auto"  # auto (flashinfer on a GPU when it fits) | torch | flashinfer
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # mixed: prompts and decodes; prefill: prompts whose KV goes to a decode worker;
    # decode: requests whose KV arrives from a prefill worker (and short local ones).
    role: str = "mixed"
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    limits: RequestLimits = field(default_factory=RequestLimits)
    # A directory for torch.profiler traces: the engine records a window between the
    # server's POST /start_profile and /stop_profile (LLM.start_profile / stop_profile
    # offline) and writes it there, on the engine's node (give an absolute path: a
    # served engine's working directory is Ray's); None: profiling is off.
    torch_profiler_dir: str | None = None

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"invalid load_format={self.load_format!r}: must be auto or dummy")
        if self.role not in ROLES:
            raise ValueError(f"invalid role={self.role!r}: must be one of {', '.join(ROLES)}")
        self.cache.check()
        self.scheduler.check()
        self.kv_transfer.check()
        self.parallel.check()
        self.cuda_graph.check()
        self.kernels.check()
        self.limits.check()
        if self.speculative_config is not None:
            self.speculative_config.check()

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens a request verifies per step; 0 without speculative decoding."""
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        """Build from nested dicts (YAML), rejecting unknown keys by name."""
        nested = {
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "kv_transfer": KVTransferConfig,
            "parallel": ParallelConfig,
            "cuda_graph": CudaGraphConfig,
            "kernels": KernelConfig,
            "speculative_config": SpeculativeConfig,
            "limits": RequestLimits,
        }
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key == "speculative_config" and value is None:
                kwargs[key] = None
            elif key in nested:
                kwargs[key] = nested[key](**known_keys(nested[key], value, prefix=f"{key}."))
            else:
                kwargs[key] = value
        return cls(**known_keys(cls, kwargs))


def known_keys(cls: type, values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``values`` unchanged, or ValueError naming the first key ``cls`` has no field for."""
    if not isinstance(values, dict):
        raise ValueError(f"config section '{prefix.rstrip('.') or cls.__name__}' must be a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            raise ValueError(
                f"unknown config key '{prefix}{key}'; accepted: {', '.join(sorted(names))}"
            )
    return values
