"""``splitserve serve`` and ``splitserve scale``: run the cluster app, resize its pools.

``serve`` starts Ray (or joins ``--address``), deploys the ingress and the
pools behind the HTTP proxy the config names (``http_front.py``), prints the
URL, and serves until Ctrl-C or SIGTERM. Then it drains: new requests get 503
with ``Retry-After``, those in flight get ``drain_timeout_s`` to finish before
they end with "shutting down" (a second signal cuts the wait short); then it
deletes the app and shuts down what it started. What can be checked before deploying is
checked in the driver (``startup_checks.py``; a context longer than the model's
is lowered to it); a replica that still fails to start ends the command with
its cause and status 1. With no arguments it serves
``configs/serve/default.yaml``: the tiny preset on CPU, one prefill and one
decode worker, on 127.0.0.1:8000.

``scale`` joins the running cluster, reads the app's config from the ingress and
the pools' sizes from Ray Serve, changes the sizes, and redeploys; a fixed pool
that keeps some replicas is resized in place (the others keep running), a pool
that appears, goes or changes between fixed and autoscaled restarts the app's
replicas.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path

from splitserve.cluster.stop_signals import StartupInterrupted, StopSignals

logger = logging.getLogger(__name__)

DRAIN_GRACE_S = 3.0  # after the drain deadline: the ingresses end the rest, errors go out


def default_config_path() -> Path:
    """The embedded default (``configs/serve/default.yaml``): tiny model, CPU."""
    return Path(str(resources.files("splitserve.configs") / "serve" / "default.yaml"))


def add_parsers(commands) -> None:
    p = commands.add_parser("serve", help="serve the OpenAI API from prefill and decode pools")
    p.add_argument("--config", type=Path, default=None, help="YAML deployment config")
    p.add_argument("--model", help="checkpoint directory or preset name")
    for pool in ("prefill", "decode", "mixed"):
        p.add_argument(f"--{pool}", type=int, metavar="N", help=f"replicas of the {pool} pool")
    p.add_argument("--host", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="where the workers run")
    p.add_argument(
        "--kv-cache-dtype",
        help="the workers' KV cache: auto (the model's dtype) or fp8_e4m3 "
        "(cache.kv_cache_dtype; every pool, so prefill and decode agree)",
    )
    p.add_argument(
        "--expert-parallel-size",
        type=int,
        metavar="N",
        help="each worker an expert-parallel group of N ranks (routed experts sharded E/N)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        metavar="N",
        help="a stream's tokens go out every N tokens, the first at once "
        "(scheduler.stream_interval; default 1: each token as it is sampled)",
    )
    p.add_argument("--address", help="join this Ray cluster instead of starting one")
    p.add_argument(
        "--speculative-config",
        help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\': every pool drafts '
        "with the checkpoint's MTP layer",
    )
    p.add_argument(
        "--torch-profiler-dir",
        metavar="DIR",
        help="turn on POST /start_profile and /stop_profile: each engine writes its "
        "torch.profiler trace (a Chrome trace) into DIR (engine.torch_profiler_dir)",
    )
    p.add_argument(
        "--api-key",
        help="clients must send 'Authorization: Bearer <key>' (else SPLITSERVE_API_KEY, "
        "else the config's http.api_key)",
    )
    p.set_defaults(run=serve_main)

    s = commands.add_parser("scale", help="change pool sizes of a running splitserve app")
    for pool in ("prefill", "decode", "mixed"):
        s.add_argument(f"--{pool}", type=int, metavar="N", help=f"replicas of the {pool} pool")
    s.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    s.add_argument("--app-name", default="splitserve")
    s.set_defaults(run=scale_main)


def load_config(args: argparse.Namespace):
    from splitserve.cluster.serve_config import ServeConfig
    from splitserve.config import env, speculative_config_from_json

    values = ServeConfig.from_yaml(args.config or default_config_path()).to_dict()
    if args.model:
        values["engine"]["model"] = args.model
    if getattr(args, "speculative_config", None):
        values["engine"]["speculative_config"] = speculative_config_from_json(
            args.speculative_config
        )
    if getattr(args, "kv_cache_dtype", None):
        values["engine"]["cache"]["kv_cache_dtype"] = args.kv_cache_dtype
    if getattr(args, "torch_profiler_dir", None):  # absolute: engines run elsewhere
        values["engine"]["torch_profiler_dir"] = str(Path(args.torch_profiler_dir).resolve())
    if getattr(args, "stream_interval", None) is not None:
        values["engine"]["scheduler"]["stream_interval"] = args.stream_interval
    if args.device:
        values["engine"]["device"] = args.device
        if args.device == "cpu":
            values["engine"]["kv_transfer"]["transport"] = "cpu"
    for key in ("host", "port"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    if getattr(args, "expert_parallel_size", None) is not None:
        parallel = values["engine"].setdefault("parallel", {})
        parallel["expert_parallel_size"] = args.expert_parallel_size
    api_key = getattr(args, "api_key", None) or env("SPLITSERVE_API_KEY")
    if api_key:
        values["http"]["api_key"] = api_key
    _resize(values, args)
    return ServeConfig.from_dict(values)


def _resize(values: dict, args: argparse.Namespace) -> None:
    """Fixed sizes from the command line (they replace autoscaling for that pool)."""
    for pool in ("prefill", "decode", "mixed"):
        n = getattr(args, pool)
        if n is not None:
            values["pools"].setdefault(pool, {})
            values["pools"][pool].update(replicas=n, min_replicas=None, max_replicas=None)


def serve_main(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from splitserve.cluster.app import deploy
    from splitserve.cluster.http_front import HAPROXY_ENV, front_environment
    from splitserve.cluster.ray_up import single_node_resources
    from splitserve.cluster.startup_checks import (
        check_node_gpus,
        check_port_free,
        deployment_failure,
        fit_to_model,
    )

    stop = StopSignals()  # from here on: a signal in start-up ends it cleanly
    started_ray = args.address is None
    run_dir = Path(tempfile.mkdtemp(prefix="splitserve-"))
    try:
        config = load_config(args)
        if started_ray:  # its HTTP front listens here
            check_port_free(config.host, config.port)
        notes = fit_to_model(config, local=started_ray)
        env = front_environment(config, run_dir) if started_ray else {}
    except (OSError, ValueError) as e:
        print(f"splitserve serve: {e}", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        return 2
    for note in notes:
        print(f"splitserve: {note}", flush=True)
    os.environ.update(env)  # the Ray instance started here inherits it
    # A Ray started here offers the pools' custom resources (pools.<pool>.resources).
    resources = single_node_resources(config) if started_ray else None
    ray.init(
        address=args.address, namespace=config.app_name, log_to_driver=False, resources=resources
    )
    stop.install()  # again: ray.init sets its own SIGTERM handler
    try:
        check_node_gpus(config, ray.nodes())
        if not started_ray and config.http.proxy == "haproxy":
            _check_cluster_haproxy_env(HAPROXY_ENV)
    except ValueError as e:
        print(f"splitserve serve: {e}", flush=True)
        if started_ray:
            ray.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
        return 2
    serve.start(http_options={"host": config.host, "port": config.port})
    try:
        try:
            with stop.interrupting():
                deploy(config)
        except Exception as e:  # a replica failed to start: its cause, once
            cause = deployment_failure(config.app_name, e)
            print(f"splitserve serve: the deployment failed: {cause}", flush=True)
            return 1
        except StartupInterrupted as e:  # Ctrl-C or SIGTERM while the replicas start
            print(f"splitserve: {e} while deploying", flush=True)
            return e.exit_code
        url = f"http://{config.host}:{config.port}/v1"
        address = ray.get_runtime_context().gcs_address
        print(f"splitserve: Ray cluster at {address}", flush=True)
        print(f"splitserve: serving {config.model_name} at {url}", flush=True)
        _drain(config, stop.wait())
    finally:
        print("splitserve: shutting down", flush=True)
        serve.delete(config.app_name)
        _remove_stats_board(config.app_name)
        if started_ray:
            serve.shutdown()
            ray.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _check_cluster_haproxy_env(expected: dict[str, str]) -> None:
    """``http.proxy: haproxy`` on a cluster started elsewhere: its Ray must have been
    started with Ray Serve's HAProxy settings (a task reads them off a worker)."""
    import ray

    @ray.remote(num_cpus=0)
    def read_env(names: list[str]) -> dict[str, str | None]:
        return {name: os.environ.get(name) for name in names}

    seen = ray.get(read_env.remote(list(expected)), timeout=60)
    missing = {k: v for k, v in expected.items() if seen.get(k) != v}
    if missing:
        names = " ".join(f"{k}={v}" for k, v in missing.items())
        raise ValueError(
            f"http.proxy: haproxy needs the cluster's Ray started with {names} (ray start "
            "reads them; cluster/launch/ sets them), or http.proxy: serve in the config"
        )


def scale_main(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from splitserve.cluster.app import deploy, deployed_pool_sizes
    from splitserve.cluster.serve_config import ServeConfig

    ray.init(address=args.address, namespace=args.app_name, log_to_driver=False)
    values = serve.get_app_handle(args.app_name).get_config.remote().result()
    for name, replicas in deployed_pool_sizes(args.app_name).items():
        pool = values["pools"][name]
        if pool["min_replicas"] is None and pool["max_replicas"] is None:
            pool["replicas"] = replicas  # the ingress's copy holds 1 (serve_application)
    _resize(values, args)
    config = ServeConfig.from_dict(values)
    deploy(config)
    sizes = ", ".join(
        f"{name}={p.replicas if not p.autoscaling else f'{p.min_replicas}..{p.max_replicas}'}"
        for name, p in config.pools.items()
    )
    print(f"splitserve: pools are now {sizes}", flush=True)
    return 0


def _remove_stats_board(namespace: str) -> None:
    import ray

    from splitserve.cluster.stats_board import BOARD_NAME

    with contextlib.suppress(ValueError):  # ValueError: it was never created
        ray.kill(ray.get_actor(BOARD_NAME, namespace=namespace))


def _drain(config, signals: list[int]) -> None:
    """Tell the ingress replicas to admit nothing new (the stats board carries the
    deadline), then wait until their requests in flight are done, at most
    ``drain_timeout_s`` (and the moment the ingresses take to end the rest), or until
    a second signal."""
    import ray

    from splitserve.cluster.metrics import INGRESS
    from splitserve.cluster.stats_board import BOARD_NAME

    try:
        board = ray.get_actor(BOARD_NAME, namespace=config.app_name)
        deadline = time.time() + config.drain_timeout_s
        ray.get(board.drain.remote(deadline), timeout=10)
    except Exception as e:  # no board (nothing was ever served) or it is gone
        logger.warning("could not start draining: %s", e)
        return
    print(
        f"splitserve: draining (up to {config.drain_timeout_s:g} s for requests in flight)",
        flush=True,
    )
    time.sleep(3 * config.stats_period_s + 0.2)  # every ingress saw it and posted since
    while len(signals) < 2 and time.time() < deadline + DRAIN_GRACE_S:
        try:
            snapshot = ray.get(board.snapshot.remote(), timeout=10)
        except Exception as e:
            logger.warning("could not read the stats board while draining: %s", e)
            return
        if not sum(s.get("in_flight", 0) for p, s in snapshot.values() if p == INGRESS):
            return
        time.sleep(0.2)
