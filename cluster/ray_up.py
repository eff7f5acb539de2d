"""A Ray cluster-launcher YAML (``ray up``) sized from a serve config.

The base is a launcher YAML of ``cluster/launch/`` (or the user's own): its provider,
instance types, images, auth and setup commands stay as they are. What the serve
config decides is written over it:

- a pool with ``resources: {prefill_gpu: 1}`` goes to the node type named
  ``prefill_gpu``. That node type offers ``prefill_gpu: k`` (k replicas a node: its
  GPUs over the pool's ``num_gpus``) and gets ``min_workers`` / ``max_workers`` from
  the pool's ``replicas`` or ``min_replicas`` .. ``max_replicas``;
- on-prem (``provider.type: local``, no node types) the hosts of each pool are given
  (``--host prefill=10.0.0.2``): each host's ``ray start`` offers its pools' resources;
- the start commands: ``ray start`` with the HTTP front's environment
  (``http.proxy: haproxy`` needs ``HAPROXY_ENV`` set before Ray starts).
"""

from __future__ import annotations

import copy
import json
import math
import shlex
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from splitserve.cluster.http_front import HAPROXY_ENV
from splitserve.cluster.serve_config import POOLS, PoolConfig, ServeConfig

PROVIDERS = ("local", "aws", "gcp")
RAY_PORT = 6379
HEAD_START = "ray start --head --port={port} --autoscaling-config=~/ray_bootstrap_config.yaml"
WORKER_START = "ray start --address=$RAY_HEAD_IP:{port}"


def base_path(provider: str) -> Path:
    """The launcher YAML shipped for ``provider``."""
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; accepted: {', '.join(PROVIDERS)}")
    return Path(str(resources.files("splitserve.cluster") / "launch" / f"{provider}.yaml"))


def load_base(path: str | Path) -> dict[str, Any]:
    with open(path) as f:
        base = yaml.safe_load(f)
    if not isinstance(base, dict) or "provider" not in base:
        raise ValueError(f"{path}: not a Ray cluster-launcher YAML (no provider section)")
    return base


def render_ray_up(
    config: ServeConfig,
    base: dict[str, Any],
    hosts: dict[str, list[str]] | None = None,
    head_ip: str | None = None,
    gpus_per_host: int = 1,
) -> dict[str, Any]:
    """``base`` with the node types (or on-prem hosts) and start commands ``config`` needs.

    ``hosts``/``head_ip``/``gpus_per_host``: on-prem only (``provider.type: local``)."""
    out = copy.deepcopy(base)
    env = HAPROXY_ENV if config.http.proxy == "haproxy" else {}
    if out["provider"].get("type") == "local":
        _place_on_hosts(out, config, hosts or {}, head_ip, gpus_per_host, env)
    else:
        if hosts or head_ip:
            raise ValueError("--host and --head-ip are for on-prem (provider.type: local) only")
        _place_on_node_types(out, config)
        out["head_start_ray_commands"] = ["ray stop", _start(HEAD_START, env, {})]
        out["worker_start_ray_commands"] = ["ray stop", _start(WORKER_START, env, {})]
    return out


def pool_slots(name: str, pool: PoolConfig, config: ServeConfig, node_gpus: float) -> int:
    """How many replicas of ``pool`` fit a node with ``node_gpus`` GPUs."""
    gpus = pool_gpus(pool, config)
    if gpus == 0:
        return 1
    slots = int(node_gpus // gpus)
    if slots < 1:
        raise ValueError(
            f"pools.{name}.num_gpus={gpus:g} does not fit a node with {node_gpus:g} GPUs; "
            "give the node type more GPUs (its resources.GPU) or the pool fewer"
        )
    return slots


def pool_gpus(pool: PoolConfig, config: ServeConfig) -> float:
    """The GPUs of one replica, as ``app.pool_deployment`` asks Ray for them."""
    if pool.num_gpus is not None:
        return pool.num_gpus
    return 1 if (config.engine.device or "").startswith("cuda") else 0


def replica_bounds(pool: PoolConfig) -> tuple[int, int]:
    if pool.autoscaling:
        return pool.min_replicas, pool.max_replicas
    return pool.replicas, pool.replicas


def single_node_resources(config: ServeConfig) -> dict[str, float]:
    """The custom resources of every pool at its largest: what a Ray instance that
    ``splitserve serve`` starts on one machine offers, so that a config made for a
    cluster (``resources: {prefill_gpu: 1}``) also runs there."""
    offer: dict[str, float] = {}
    for pool in _active_pools(config).values():
        for key, amount in pool.resources.items():
            offer[key] = offer.get(key, 0) + amount * replica_bounds(pool)[1]
    return offer


def _active_pools(config: ServeConfig) -> dict[str, PoolConfig]:
    return {name: config.pools[name] for name in POOLS if config.pools[name].active}


def _place_on_node_types(out: dict[str, Any], config: ServeConfig) -> None:
    types = out.get("available_node_types") or {}
    for name, pool in _active_pools(config).items():
        matches = [key for key in pool.resources if key in types]
        if not pool.resources:
            continue
        if len(matches) != 1:
            raise ValueError(
                f"pools.{name}.resources={pool.resources}: exactly one of its names must be "
                f"a node type of the launcher YAML; node types: {', '.join(types)}"
            )
        node_type = types[matches[0]]
        if matches[0] == out.get("head_node_type"):
            raise ValueError(f"pools.{name}: {matches[0]} is the head node type")
        node_resources = node_type.setdefault("resources", {})
        slots = pool_slots(name, pool, config, node_resources.get("GPU", 0))
        node_resources.update({key: amount * slots for key, amount in pool.resources.items()})
        low, high = replica_bounds(pool)
        node_type["min_workers"] = math.ceil(low / slots)
        node_type["max_workers"] = math.ceil(high / slots)
    out["max_workers"] = sum(t.get("max_workers", 0) for t in types.values())


def _place_on_hosts(
    out: dict[str, Any],
    config: ServeConfig,
    hosts: dict[str, list[str]],
    head_ip: str | None,
    gpus_per_host: int,
    env: dict[str, str],
) -> None:
    """On-prem: every host of a pool offers that pool's resources from its ``ray start``."""
    if head_ip is None or not hosts:
        raise ValueError(
            "an on-prem cluster (provider.type: local) needs --head-ip HOST and the hosts "
            "of each pool, e.g. --host prefill=10.0.0.2,10.0.0.3 --host decode=10.0.0.4"
        )
    unknown = set(hosts) - set(_active_pools(config))
    if unknown:
        raise ValueError(f"--host names {sorted(unknown)[0]!r}, not an active pool of the config")
    offers: dict[str, dict[str, float]] = {}
    for name, pool in _active_pools(config).items():
        pool_hosts = hosts.get(name, [])
        if not pool.resources:
            continue
        if not pool_hosts:
            raise ValueError(f"pools.{name} has resources {pool.resources}: give its hosts")
        slots = pool_slots(name, pool, config, gpus_per_host)
        _, high = replica_bounds(pool)
        if slots * len(pool_hosts) < high:
            raise ValueError(
                f"pools.{name} may run {high} replicas; its {len(pool_hosts)} hosts of "
                f"{gpus_per_host} GPUs hold {slots * len(pool_hosts)}"
            )
        for host in pool_hosts:
            offer = offers.setdefault(host, {})
            for key, amount in pool.resources.items():
                offer[key] = offer.get(key, 0) + amount * slots
    workers = [h for h in dict.fromkeys(h for hs in hosts.values() for h in hs) if h != head_ip]
    out["provider"]["head_ip"] = head_ip
    out["provider"]["worker_ips"] = workers
    out["max_workers"] = len(workers)
    out["head_start_ray_commands"] = ["ray stop", _start(HEAD_START, env, offers.get(head_ip, {}))]
    out["worker_start_ray_commands"] = ["ray stop", _worker_start_by_host(env, offers)]


def _start(command: str, env: dict[str, str], offer: dict[str, float]) -> str:
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())
    line = command.format(port=RAY_PORT)
    if offer:
        line += f" --resources={shlex.quote(json.dumps(offer))}"
    return exports + line


def _worker_start_by_host(env: dict[str, str], offers: dict[str, dict[str, float]]) -> str:
    """One start command for every worker host: a ``case`` on the host's names and
    addresses picks its resources."""
    arms = [
        f'*" {host} "*) RESOURCES={shlex.quote(json.dumps(offer))} ;;'
        for host, offer in offers.items()
    ]
    arms.append("*) RESOURCES='{}' ;;")
    case = f'case " $(hostname) $(hostname -I 2>/dev/null) " in {" ".join(arms)} esac; '
    return case + _start(WORKER_START, env, {}) + ' --resources="$RESOURCES"'
