"""Build the Ray Serve application: the ingress and one deployment per worker pool.

The application's secret, made here, goes to the ingress and every worker: an
engine process takes connections only from fronts that present it.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from splitserve.cluster.autoscaling import PoolAutoscalingPolicy
from splitserve.cluster.ingress import OpenAIIngress
from splitserve.cluster.request_router import PoolRequestRouter
from splitserve.cluster.serve_config import POOLS, PoolConfig, ServeConfig
from splitserve.cluster.worker_deployment import EngineWorker
from splitserve.workers.engine.engine_client import SHUTDOWN_TIMEOUT_S


def build_app(config: ServeConfig) -> serve.Application:
    engine = _engine_dict(config)
    secret = secrets.token_hex(16)
    pools = {}
    for name in POOLS:
        pool = config.pools[name]
        if pool.active:
            deployment = pool_deployment(name, pool, config)
            pools[name] = deployment.bind(
                name,
                engine,
                config.stats_period_s,
                config.app_name,
                secret,
                pool.max_ongoing_requests,
                pool.watchdog_timeout_s,
                config.drain_timeout_s,
            )
    return ingress_deployment(config).bind(
        config.to_dict(), secret, pools.get("prefill"), pools.get("decode"), pools.get("mixed")
    )


def ingress_deployment(config: ServeConfig) -> serve.Deployment:
    """The HTTP front: fixed replicas, or autoscaled on ongoing requests (Ray Serve's own
    policy), behind Ray Serve's proxy."""
    ingress = config.ingress
    options: dict = dict(
        ray_actor_options={"num_cpus": ingress.num_cpus},
        max_ongoing_requests=ingress.max_ongoing_requests,
        # Ray Serve waits for a leaving replica's HTTP requests, then calls its __del__.
        graceful_shutdown_timeout_s=config.drain_timeout_s + 5.0,
    )
    if ingress.autoscaling:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=ingress.min_replicas,
            max_replicas=ingress.max_replicas,
            target_ongoing_requests=ingress.target_ongoing_requests,
            upscale_delay_s=5.0,
            downscale_delay_s=60.0,
        )
    else:
        options["num_replicas"] = ingress.replicas
    return OpenAIIngress.options(**options)


def pool_deployment(name: str, pool: PoolConfig, config: ServeConfig) -> serve.Deployment:
    on_gpu = (config.engine.device or "").startswith("cuda")
    gpus = pool.num_gpus if pool.num_gpus is not None else (1 if on_gpu else 0)
    options = dict(
        name=name,
        ray_actor_options={
            "num_cpus": pool.num_cpus,
            "num_gpus": gpus,
            "resources": pool.resources,
        },
        health_check_period_s=2.0,
        # A replica too hung to answer is replaced as one whose engine stalled.
        health_check_timeout_s=pool.watchdog_timeout_s,
        # Its engine drains first (``EngineWorker.__del__``), then gets its own stop time.
        graceful_shutdown_timeout_s=config.drain_timeout_s + SHUTDOWN_TIMEOUT_S + 5.0,
        request_router_config=RequestRouterConfig(request_router_class=PoolRequestRouter),
    )
    if pool.autoscaling:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=pool.min_replicas,
            max_replicas=pool.max_replicas,
            policy=AutoscalingPolicy(
                policy_function=PoolAutoscalingPolicy,
                policy_kwargs={
                    "pool": name,
                    "target_queued_prompt_tokens": pool.target_queued_prompt_tokens,
                    "target_running_requests": pool.target_running_requests,
                    "target_kv_usage": pool.target_kv_usage,
                },
            ),
            upscale_delay_s=5.0,
            downscale_delay_s=60.0,
        )
    else:
        options["num_replicas"] = pool.replicas
    return serve.deployment(EngineWorker).options(**options)


def _engine_dict(config: ServeConfig) -> dict:
    engine = asdict(config.engine)
    engine.pop("role")  # each pool sets its own
    return engine


def app_builder(args: dict) -> serve.Application:
    """The application of a Ray Serve config file (``serve deploy``, KubeRay's
    serveConfigV2): ``import_path: splitserve.cluster.app:app_builder``, its ``args`` a
    serve config (``splitserve render --target serve-config`` writes one)."""
    return build_app(ServeConfig.from_dict(args))
