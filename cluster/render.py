"""``splitserve render``: the cluster's files, written from one serve config.

The serve config (``configs/serve/*.yaml``) is the single source; a pool's size,
GPUs, custom resources and autoscaling bounds are written there once.

- ``--target serve-config``: a Ray Serve config file (``serve deploy``; KubeRay's
  ``serveConfigV2``) whose one application is the one ``splitserve serve`` deploys:
  built by ``splitserve.cluster.app:app_builder`` with the serve config as its args;
- ``--target helm``: values for the ``helm/splitserve`` chart: that application under
  ``application``; the chart derives the worker groups and ``serveConfigV2`` from it;
- ``--target ray-up``: a cluster-launcher YAML (``ray_up.py``).

The application's KV hand-off key (``engine.kv_transfer.auth_key``) is never written:
each deployment makes its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

TARGETS = ("serve-config", "helm", "ray-up")
ALWAYS_WRITTEN = ("app_name", "host", "port")  # the chart and http_options read them
POOL_PLACEMENT = ("replicas", "min_replicas", "max_replicas", "num_gpus", "resources")


def add_parser(commands) -> None:
    p = commands.add_parser(
        "render", help="write the Ray Serve config, Helm values or ray up YAML of a serve config"
    )
    p.add_argument("config", type=Path, help="serve config YAML (configs/serve/*.yaml)")
    p.add_argument("--target", required=True, choices=TARGETS)
    p.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    up = p.add_argument_group("ray-up")
    up.add_argument("--provider", default="aws", help="the shipped base: local, aws or gcp")
    up.add_argument("--launch", type=Path, help="a launcher YAML to start from (not --provider)")
    up.add_argument("--head-ip", help="on-prem: the head host")
    up.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="POOL=HOST[,HOST]",
        help="on-prem: hosts of a pool (repeatable)",
    )
    up.add_argument("--gpus-per-host", type=int, default=1, help="on-prem: GPUs of each host")
    p.set_defaults(run=render_main)


def render_main(args: argparse.Namespace) -> int:
    from splitserve.cluster.serve_config import ServeConfig

    try:
        config = ServeConfig.from_yaml(args.config)
        text = yaml.safe_dump(render(config, args), sort_keys=False, width=100)
    except (OSError, ValueError) as e:
        print(f"splitserve render: {e}", file=sys.stderr, flush=True)
        return 2
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def render(config, args: argparse.Namespace) -> dict[str, Any]:
    if args.target == "serve-config":
        return serve_config_file(config)
    if args.target == "helm":
        return helm_values(config)
    from splitserve.cluster import ray_up

    base = ray_up.load_base(args.launch or ray_up.base_path(args.provider))
    return ray_up.render_ray_up(
        config, base, parse_hosts(args.host), args.head_ip, args.gpus_per_host
    )


def app_args(config) -> dict[str, Any]:
    """The serve config as an application's ``args``: what differs from the defaults,
    the HTTP address and each pool's size, GPUs and resources in full (the Helm chart
    reads them); never the KV hand-off key."""
    from splitserve.cluster.serve_config import PoolConfig, ServeConfig

    args = _changed(config, ServeConfig()) | {k: getattr(config, k) for k in ALWAYS_WRITTEN}
    args.get("engine", {}).get("kv_transfer", {}).pop("auth_key", None)
    args["pools"] = {
        name: {key: getattr(pool, key) for key in POOL_PLACEMENT} | _changed(pool, PoolConfig())
        for name, pool in config.pools.items()
    }
    return args


def _changed(values, defaults) -> dict[str, Any]:
    """The fields of dataclass ``values`` that differ from ``defaults``, nested sections
    as far down as they differ."""
    out = {}
    for f in dataclasses.fields(values):
        value, default = getattr(values, f.name), getattr(defaults, f.name)
        if dataclasses.is_dataclass(value) and type(value) is type(default):
            section = _changed(value, default)
            if section:
                out[f.name] = section
        elif value != default:
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def application(config) -> dict[str, Any]:
    """The application ``splitserve serve`` deploys (``app.serve_application``: the
    builder, deployment options, autoscaling policy), its ``args`` as ``app_args``."""
    from splitserve.cluster.app import serve_application
    from splitserve.cluster.serve_config import ServeConfig

    app = serve_application(config)
    app["args"] = app_args(ServeConfig.from_dict(app["args"]))
    return app


def serve_config_file(config) -> dict[str, Any]:
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": config.host, "port": config.port},
        "applications": [application(config)],
    }


def helm_values(config) -> dict[str, Any]:
    return {"application": application(config)}


def parse_hosts(specs: list[str]) -> dict[str, list[str]]:
    hosts: dict[str, list[str]] = {}
    for spec in specs:
        pool, sep, names = spec.partition("=")
        listed = [h for h in names.split(",") if h]
        if not sep or not pool or not listed:
            raise ValueError(f"invalid --host {spec!r}: must be POOL=HOST[,HOST...]")
        hosts.setdefault(pool, []).extend(listed)
    return hosts
