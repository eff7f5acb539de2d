"""The deployment config of ``splitserve serve``: engine, pools, router, HTTP.

YAML files in ``configs/serve/`` hold it; every key is checked and a misspelled
one is an error naming it (``pools.decode.max_replica``). A pool with
``min_replicas`` and ``max_replicas`` autoscales (one application-level policy
over every autoscaled pool, ``cluster/autoscaling.py``, set by ``autoscaling`` and
``slo``); otherwise it runs ``replicas`` replicas.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from splitserve.cluster.autoscaling import ScalingConfig, SloConfig
from splitserve.cluster.routing import RouterConfig
from splitserve.config import EngineConfig, known_keys

POOLS = ("prefill", "decode", "mixed")
PROXIES = ("haproxy", "serve")  # http.proxy
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


@dataclass
class PoolConfig:
    replicas: int = 1  # fixed size when not autoscaling
    min_replicas: int | None = None  # autoscale between these two when both are set
    max_replicas: int | None = None
    num_cpus: float = 0.0  # Ray resources per replica
    num_gpus: float | None = None  # None: 1 when the engine runs on CUDA, else 0
    # Custom Ray resources per replica, e.g. {prefill_gpu: 1}: the replica goes only to
    # nodes that offer them (a ``ray up`` node type or a KubeRay worker group of that
    # name; ``splitserve render`` writes both from this key).
    resources: dict[str, float] = field(default_factory=dict)
    max_ongoing_requests: int = 512  # per replica: its engine answers Overloaded beyond it
    # Requests an ingress replica holds while every replica of this pool is at its
    # max_ongoing_requests; beyond it a request gets 503.
    max_queued_requests: int = 4096
    # Autoscaling targets per replica: the prefill pool scales on queued prompt
    # tokens, the decode and mixed pools on running requests and KV usage.
    target_queued_prompt_tokens: int = 8192
    target_running_requests: int = 48
    target_kv_usage: float = 0.8
    # A hung worker (SIGSTOP, a wedged device): an ingress routes around an engine that
    # sent no load report, or made no step while holding requests, for stall_timeout_s,
    # and ends its open streams (those without a token yet are retried elsewhere); it
    # comes back once its reports resume. After watchdog_timeout_s without progress the
    # replica's health check fails, so Ray Serve replaces it. A single engine step must
    # stay well below stall_timeout_s. While the engine process's heartbeats say its
    # loop is inside one step (a kernel build, a very long prompt), the health check
    # fails only once that step has run step_timeout_s (SGLang's watchdog: 300 s): a
    # replacement would meet the same step and be killed in turn.
    stall_timeout_s: float = 2.0
    watchdog_timeout_s: float = 10.0
    step_timeout_s: float = 300.0

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def check(self, name: str) -> None:
        def bad(key: str, accepted: str) -> ValueError:
            return ValueError(
                f"invalid pools.{name}.{key}={getattr(self, key)!r}: must be {accepted}"
            )

        if self.replicas < 0:
            raise bad("replicas", ">= 0")
        if self.autoscaling:
            if self.min_replicas is None or self.max_replicas is None:
                raise ValueError(f"pools.{name}: set both min_replicas and max_replicas")
            if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
                raise bad("max_replicas", f">= max(1, min_replicas={self.min_replicas})")
        if self.max_ongoing_requests < 1:
            raise bad("max_ongoing_requests", ">= 1")
        self._check_resources(name)
        if self.max_queued_requests < 1:
            raise bad("max_queued_requests", ">= 1")
        if self.target_queued_prompt_tokens < 1:
            raise bad("target_queued_prompt_tokens", ">= 1")
        if self.target_running_requests < 1:
            raise bad("target_running_requests", ">= 1")
        if not 0.0 < self.target_kv_usage <= 1.0:
            raise bad("target_kv_usage", "in (0, 1]")
        if not self.stall_timeout_s > 0:
            raise bad("stall_timeout_s", "> 0")
        if not self.watchdog_timeout_s >= self.stall_timeout_s:
            raise bad("watchdog_timeout_s", f">= stall_timeout_s={self.stall_timeout_s}")
        if not self.step_timeout_s >= self.watchdog_timeout_s:
            raise bad("step_timeout_s", f">= watchdog_timeout_s={self.watchdog_timeout_s}")

    def _check_resources(self, name: str) -> None:
        resources = self.resources
        if not isinstance(resources, dict) or not all(
            isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool)
            for k, v in resources.items()
        ):
            raise ValueError(
                f"invalid pools.{name}.resources={resources!r}: must map resource names to "
                "numbers, e.g. {prefill_gpu: 1}"
            )
        for key, amount in resources.items():
            if key in RAY_BUILTIN_RESOURCES:
                raise ValueError(
                    f"invalid pools.{name}.resources.{key}: CPU and GPU are num_cpus and "
                    "num_gpus; resources holds custom ones, e.g. {prefill_gpu: 1}"
                )
            if not amount > 0:
                raise ValueError(f"invalid pools.{name}.resources.{key}={amount!r}: must be > 0")

    @property
    def active(self) -> bool:
        return (self.max_replicas or 0) > 0 if self.autoscaling else self.replicas > 0

    def replica_gpus(self, engine: EngineConfig) -> float:
        """GPUs a replica takes: ``num_gpus``, else on CUDA one per rank of its engine (an
        expert-parallel group's ranks are processes of the replica, on its GPUs)."""
        if self.num_gpus is not None:
            return self.num_gpus
        on_gpu = (engine.device or "").startswith("cuda")
        return engine.parallel.expert_parallel_size if on_gpu else 0


@dataclass
class IngressConfig:
    """The HTTP front's replicas (behind Ray Serve's proxy): ``replicas``, or autoscaling
    between ``min_replicas`` and ``max_replicas`` on ongoing requests per replica."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: int = 256  # per replica, when autoscaling
    max_ongoing_requests: int = 2048  # per replica
    num_cpus: float = 0.0

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def check(self) -> None:
        def bad(key: str, accepted: str) -> ValueError:
            return ValueError(f"invalid ingress.{key}={getattr(self, key)!r}: must be {accepted}")

        if self.replicas < 1:
            raise bad("replicas", ">= 1")
        if self.autoscaling:
            if self.min_replicas is None or self.max_replicas is None:
                raise ValueError("ingress: set both min_replicas and max_replicas")
            if not 1 <= self.min_replicas <= self.max_replicas:
                raise bad("max_replicas", f">= min_replicas={self.min_replicas} >= 1")
        if self.target_ongoing_requests < 1:
            raise bad("target_ongoing_requests", ">= 1")
        if self.max_ongoing_requests < 1:
            raise bad("max_ongoing_requests", ">= 1")


@dataclass
class HttpConfig:
    """What the HTTP front accepts (``cluster/http_guard.py``).

    ``api_key``: clients must send ``Authorization: Bearer <api_key>`` (401 otherwise);
    None: no key (``--api-key`` and ``SPLITSERVE_API_KEY`` set it from outside the file).
    ``auth_health_and_metrics``: whether ``/health`` and ``/metrics`` need the key too.
    ``cors_origins``: origins a browser may call from (``["*"]`` for any); empty: no CORS.
    ``max_body_bytes``: larger bodies get 413 before they are read. The default holds a
    prompt of a million token ids; a text prompt is also bounded by the context length.
    ``proxy``: what carries HTTP to the ingress replicas. ``haproxy`` (Ray Serve's HAProxy
    mode): HAProxy on ``host:port`` forwards each connection to an ingress replica's
    own HTTP server, with no Ray call on the way (``cluster/http_front.py``); ``serve``:
    Ray Serve's proxy actor, one more Ray call per request and per streamed chunk.
    """

    api_key: str | None = None
    auth_health_and_metrics: bool = False
    cors_origins: list[str] = field(default_factory=list)
    max_body_bytes: int = 16 * 2**20
    proxy: str = "haproxy"

    def check(self) -> None:
        if self.proxy not in PROXIES:
            raise ValueError(
                f"invalid http.proxy={self.proxy!r}: must be one of {', '.join(PROXIES)}"
            )
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("invalid http.api_key: must be a non-empty string or null")
        if not isinstance(self.auth_health_and_metrics, bool):
            raise ValueError(
                f"invalid http.auth_health_and_metrics={self.auth_health_and_metrics!r}: "
                "must be true or false"
            )
        origins = self.cors_origins
        if not isinstance(origins, list) or not all(isinstance(o, str) and o for o in origins):
            raise ValueError(
                f"invalid http.cors_origins={origins!r}: must be a list of origins "
                "(https://app.example.com, or * for any)"
            )
        size = self.max_body_bytes
        if not isinstance(size, int) or isinstance(size, bool) or size < 1024:
            raise ValueError(f"invalid http.max_body_bytes={size!r}: must be an integer >= 1024")


def _default_pools() -> dict[str, PoolConfig]:
    return {"prefill": PoolConfig(), "decode": PoolConfig(), "mixed": PoolConfig(replicas=0)}


@dataclass
class ServeConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None  # default: the model's name or directory name
    pools: dict[str, PoolConfig] = field(default_factory=_default_pools)
    router: RouterConfig = field(default_factory=RouterConfig)
    ingress: IngressConfig = field(default_factory=IngressConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    autoscaling: ScalingConfig = field(default_factory=ScalingConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = "splitserve"
    stats_period_s: float = 0.25  # how often workers report their load
    # Shutdown (SIGINT/SIGTERM of ``serve``) and a worker replica leaving (scale-down):
    # new requests get 503 with Retry-After, those in flight get this long to finish,
    # then end with a "shutting down" error.
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        self.ingress.check()
        self.http.check()
        self.autoscaling.check()
        self.slo.check()
        if self.engine.kv_transfer.auth_key is None:  # one per application, sent to every worker
            self.engine.kv_transfer.auth_key = secrets.token_hex(32)
        unknown = set(self.pools) - set(POOLS)
        if unknown:
            raise ValueError(f"unknown pool {sorted(unknown)[0]!r}; pools: {', '.join(POOLS)}")
        for name in POOLS:
            self.pools.setdefault(name, PoolConfig(replicas=0))
            self.pools[name].check(name)
        self.router.check()
        ep = self.engine.parallel.expert_parallel_size
        for name, pool in self.pools.items():
            if ep > 1 and pool.num_gpus is not None and 0 < pool.num_gpus < ep:
                raise ValueError(
                    f"invalid pools.{name}.num_gpus={pool.num_gpus}: with "
                    f"parallel.expert_parallel_size={ep} a replica is a group of {ep} ranks, "
                    f"one GPU each; set num_gpus to {ep} or leave it out"
                )
        if not (
            self.pools["mixed"].active
            or (self.pools["prefill"].active and self.pools["decode"].active)
        ):
            raise ValueError(
                "no worker can serve: give the mixed pool replicas, or both prefill and decode"
            )
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"invalid drain_timeout_s={self.drain_timeout_s}: must be >= 0")
        if not 0 < self.port < 65536:
            raise ValueError(f"invalid port={self.port}: must be in 1..65535")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).name

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ServeConfig:
        values = dict(known_keys(cls, values))
        if "engine" in values:
            values["engine"] = EngineConfig.from_dict(values["engine"])
        if "router" in values:
            values["router"] = RouterConfig(**known_keys(RouterConfig, values["router"], "router."))
        if "ingress" in values:
            ingress = values["ingress"] or {}
            values["ingress"] = IngressConfig(**known_keys(IngressConfig, ingress, "ingress."))
        if "http" in values:
            values["http"] = HttpConfig(**known_keys(HttpConfig, values["http"] or {}, "http."))
        for key, section in (("autoscaling", ScalingConfig), ("slo", SloConfig)):
            if key in values:
                values[key] = section(**known_keys(section, values[key] or {}, f"{key}."))
        if "pools" in values:
            pools = {}
            for name, pool in (values["pools"] or {}).items():
                pools[name] = PoolConfig(**known_keys(PoolConfig, pool or {}, f"pools.{name}."))
            values["pools"] = pools
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServeConfig:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
        try:
            return cls.from_dict(values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
