"""Build the Ray Serve application: the ingress and one deployment per worker pool.

The application's secret, made here, goes to the ingress and every worker: an
engine process takes connections only from fronts that present it.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from splitserve.cluster.autoscaling import limits_of
from splitserve.cluster.autoscaling_policy import GoodputPolicy, policy_kwargs
from splitserve.cluster.ingress import OpenAIIngress
from splitserve.cluster.request_router import PoolRequestRouter
from splitserve.cluster.serve_config import POOLS, PoolConfig, ServeConfig
from splitserve.cluster.worker_deployment import EngineWorker
from splitserve.workers.engine.engine_client import SHUTDOWN_TIMEOUT_S

# The ingress's handlers run on the replica's own event loop, the one its HTTP server
# (direct ingress) runs on, not on a second loop in another thread: every streamed chunk
# otherwise crosses between the two threads (a thread-safe queue and a loop wake-up
# each). The handlers never block long (a large body and long text are parsed and
# tokenized in a thread).
# A leaving ingress replica behind HAProxy stays reachable this long before it closes its
# listener (Ray Serve's default is 30 s, for load balancers to deregister it). Ray Serve's
# HAProxy retries a refused connection on another replica, and ``splitserve serve`` drains
# the ingresses itself before deleting the app, so the default window only held every
# Ctrl-C of an idle server for 30 s.
INGRESS_DEREGISTER_S = 2.0
INGRESS_RUNTIME_ENV = {
    "env_vars": {
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(INGRESS_DEREGISTER_S),
    }
}


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
                pool.step_timeout_s,
            )
    return ingress_deployment(config).bind(
        config.to_dict(), secret, pools.get("prefill"), pools.get("decode"), pools.get("mixed")
    )


def ingress_deployment(config: ServeConfig) -> serve.Deployment:
    """The HTTP front: fixed replicas, or autoscaled on ongoing requests (Ray Serve's own
    policy), behind Ray Serve's proxy."""
    ingress = config.ingress
    options: dict = dict(
        ray_actor_options={"num_cpus": ingress.num_cpus, "runtime_env": INGRESS_RUNTIME_ENV},
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
    gpus = pool.replica_gpus(config.engine)
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
        # Sized by the app's policy (``serve_application``), which applies its own delays;
        # a pool that may go to zero starts with one replica.
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=pool.min_replicas,
            max_replicas=pool.max_replicas,
            initial_replicas=max(pool.min_replicas, 1),
            upscale_delay_s=0.0,
            downscale_delay_s=0.0,
            downscale_to_zero_delay_s=0.0,
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


def serve_application(config: ServeConfig) -> dict:
    """The app as a Ray Serve config file's application (``ServeApplicationSchema``):
    built by ``app_builder`` from the serve config, and, when a pool autoscales, the
    application-level autoscaling policy over the autoscaled pools (``GoodputPolicy``).

    A fixed pool's size is a deployment option of the file, not part of ``args`` (they
    hold 1 for it): a change of ``args`` restarts every replica, a change of
    ``num_replicas`` alone resizes the pool in place (``splitserve scale``)."""
    args = config.to_dict()
    sizes = [
        {"name": name, "num_replicas": pool.replicas}
        for name, pool in config.pools.items()
        if pool.active and not pool.autoscaling
    ]
    for size in sizes:
        args["pools"][size["name"]]["replicas"] = 1
    app = {
        "name": config.app_name,
        "route_prefix": "/",
        "import_path": "splitserve.cluster.app:app_builder",
        "args": args,
        "deployments": sizes,
    }
    pools = {n: limits_of(p) for n, p in config.pools.items() if p.active and p.autoscaling}
    if pools:
        kwargs = policy_kwargs(pools, config.autoscaling, config.slo, config.stats_period_s)
        policy = f"{GoodputPolicy.__module__}:{GoodputPolicy.__name__}"
        app["autoscaling_policy"] = {"policy_function": policy, "policy_kwargs": kwargs}
    return app


def deploy(config: ServeConfig, timeout_s: float = 900.0) -> None:
    """Deploy (or redeploy) the app as a Ray Serve config file would (the way an
    application-level autoscaling policy is set) and wait until it runs; RuntimeError
    with the deployments' messages when it fails. Serve must be started."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    app = ServeApplicationSchema(**serve_application(config))
    _get_global_client().deploy_apps(ServeDeploySchema(applications=[app]))
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(0.5)
        status = serve.status().applications.get(config.app_name)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            messages = [d.message for d in status.deployments.values() if d.message]
            raise RuntimeError("\n".join([status.message, *messages]))
        if time.monotonic() > deadline:
            raise RuntimeError(f"the app did not start within {timeout_s:g} s: {status}")


def deployed_pool_sizes(app_name: str) -> dict[str, int]:
    """The replicas each pool of the running app is asked for (Ray Serve's targets)."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()["applications"][app_name]
    return {
        name: d["target_num_replicas"]
        for name, d in details["deployments"].items()
        if name in POOLS
    }
