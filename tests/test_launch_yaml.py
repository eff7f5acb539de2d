"""The ``ray up`` YAMLs of cluster/launch/: Ray's own validation, and the node types,
hosts and start commands ``splitserve render --target ray-up`` writes from a serve config."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from splitserve.cluster import ray_up
from splitserve.cluster.app import pool_deployment
from splitserve.cluster.cli import main
from splitserve.cluster.serve_config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "cluster" / "launch"
GPU_CLUSTER = ROOT / "configs" / "serve" / "gpu-cluster.yaml"
# The hosts cluster/launch/local.yaml was written for (its header says how).
LOCAL_HOSTS = {"prefill": ["10.0.0.2", "10.0.0.3"], "decode": ["10.0.0.4", "10.0.0.5"]}
HAPROXY = "export RAY_SERVE_ENABLE_HA_PROXY=1; export RAY_SERVE_ENABLE_DIRECT_INGRESS=1; "


def _validate(launch: dict) -> dict:
    prepared = prepare_config(copy.deepcopy(launch))
    validate_config(prepared)
    return prepared


def _render(provider: str, config: ServeConfig, **on_prem) -> dict:
    base = ray_up.load_base(ray_up.base_path(provider))
    return ray_up.render_ray_up(config, base, **on_prem)


@pytest.mark.parametrize("path", sorted(LAUNCH.glob("*.yaml")), ids=lambda p: p.name)
def test_every_launch_yaml_passes_rays_validation(path):
    launch = yaml.safe_load(path.read_text())
    prepared = _validate(launch)
    assert prepared["provider"]["type"] == path.stem
    assert all(HAPROXY in c for c in prepared["head_start_ray_commands"][1:])
    assert any("splitserve" in c for c in prepared["setup_commands"])


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_cloud_yaml_is_what_render_writes_for_the_gpu_cluster_config(provider):
    config = ServeConfig.from_yaml(GPU_CLUSTER)
    base = ray_up.load_base(ray_up.base_path(provider))
    assert ray_up.render_ray_up(config, base) == base
    types = base["available_node_types"]
    assert types["prefill_gpu"]["resources"]["prefill_gpu"] == 1
    assert types["decode_gpu"]["resources"]["decode_gpu"] == 1
    assert (types["prefill_gpu"]["min_workers"], types["prefill_gpu"]["max_workers"]) == (1, 4)
    assert base["max_workers"] == 8


def test_local_yaml_is_what_render_writes_for_its_hosts():
    config = ServeConfig.from_yaml(GPU_CLUSTER)
    base = ray_up.load_base(ray_up.base_path("local"))
    rendered = ray_up.render_ray_up(config, base, LOCAL_HOSTS, "10.0.0.1", gpus_per_host=2)
    assert rendered == base
    assert base["provider"]["worker_ips"] == ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]


def test_node_types_follow_the_pools_sizes_gpus_and_resources():
    values = yaml.safe_load(GPU_CLUSTER.read_text())
    values["pools"]["prefill"].update(min_replicas=2, max_replicas=7, num_gpus=2)
    values["pools"]["decode"] = {"replicas": 3, "num_gpus": 1, "resources": {"decode_gpu": 0.5}}
    values["http"] = {"proxy": "serve"}
    config = ServeConfig.from_dict(values)
    base = ray_up.load_base(ray_up.base_path("aws"))
    for node_type in ("prefill_gpu", "decode_gpu"):  # 4 GPUs a node
        base["available_node_types"][node_type]["resources"]["GPU"] = 4
    launch = _validate(ray_up.render_ray_up(config, base))
    prefill, decode = (launch["available_node_types"][t] for t in ("prefill_gpu", "decode_gpu"))
    # 2 replicas of 2 GPUs a node: 2..7 replicas -> 1..4 nodes
    assert prefill["resources"] == {"CPU": 8, "GPU": 4, "prefill_gpu": 2}
    assert (prefill["min_workers"], prefill["max_workers"]) == (1, 4)
    # 4 replicas of 1 GPU a node: a fixed 3 -> 1 node
    assert decode["resources"]["decode_gpu"] == 2.0
    assert (decode["min_workers"], decode["max_workers"]) == (1, 1)
    assert launch["max_workers"] == 5
    assert not any("HA_PROXY" in c for c in launch["head_start_ray_commands"])


def test_on_prem_hosts_offer_their_pools_resources():
    config = ServeConfig.from_yaml(GPU_CLUSTER)
    hosts = {"prefill": ["gpu-a", "gpu-b"], "decode": ["head", "gpu-c"]}
    launch = _validate(_render("local", config, hosts=hosts, head_ip="head", gpus_per_host=4))
    assert launch["provider"]["worker_ips"] == ["gpu-a", "gpu-b", "gpu-c"]
    head = launch["head_start_ray_commands"][-1]
    assert head.endswith("""--resources='{"decode_gpu": 4}'""")
    worker = launch["worker_start_ray_commands"][-1]
    # The case picks each host's offer; run it as that host would.
    for host, offer in [("gpu-b", '{"prefill_gpu": 4}'), ("gpu-c", '{"decode_gpu": 4}')]:
        case = worker.split("export")[0].replace("$(hostname)", host)
        script = case.replace("$(hostname -I 2>/dev/null)", "") + 'echo "$RESOURCES"'
        assert subprocess.run(["sh", "-c", script], capture_output=True, text=True).stdout == (
            offer + "\n"
        )


@pytest.mark.parametrize(
    ("change", "on_prem", "message"),
    [
        ({"prefill": {"resources": {"prefill_tpu": 1}}}, None, "exactly one of its names"),
        ({"prefill": {"num_gpus": 2}}, None, "num_gpus=2 does not fit a node with 1 GPUs"),
        ({}, {"hosts": {}, "head_ip": None}, "needs --head-ip HOST and the hosts"),
        ({}, {"hosts": {"prefill": ["a"], "decode": ["b"]}, "head_ip": "h"}, "its 1 hosts"),
        ({}, {"hosts": {"prefil": ["a"]}, "head_ip": "h"}, "'prefil', not an active pool"),
        ({}, {"hosts": {"decode": ["a"] * 4}, "head_ip": "h"}, "prefill_gpu.*give its hosts"),
    ],
)
def test_bad_launch_input_says_what_is_wrong(change, on_prem, message):
    values = yaml.safe_load(GPU_CLUSTER.read_text())
    for pool, keys in change.items():
        values["pools"][pool].update(keys)
    config = ServeConfig.from_dict(values)
    with pytest.raises(ValueError, match=message):
        if on_prem is None:
            _render("aws", config)
        else:
            _render("local", config, gpus_per_host=1, **on_prem)


def test_a_pools_resources_reach_its_replicas_actor_options():
    config = ServeConfig.from_yaml(GPU_CLUSTER)
    options = pool_deployment("prefill", config.pools["prefill"], config).ray_actor_options
    assert options["resources"] == {"prefill_gpu": 1} and options["num_gpus"] == 1
    for bad, message in [
        ({"GPU": 1}, "resources.GPU: CPU and GPU are num_cpus and num_gpus"),
        ({"prefill_gpu": 0}, "resources.prefill_gpu=0: must be > 0"),
        ({"prefill_gpu": "one"}, "must map resource names to numbers"),
    ]:
        with pytest.raises(ValueError, match=message):
            ServeConfig.from_dict({"pools": {"prefill": {"resources": bad}, "decode": {}}})


def test_render_cli_writes_a_valid_launch_yaml(tmp_path, capsys):
    out = tmp_path / "cluster.yaml"
    args = ["render", "--target", "ray-up", "--provider", "gcp", "-o", str(out), str(GPU_CLUSTER)]
    assert main(args) == 0
    assert _validate(yaml.safe_load(out.read_text()))["provider"]["type"] == "gcp"
    assert main(["render", "--target", "ray-up", "--provider", "local", str(GPU_CLUSTER)]) == 2
    assert "needs --head-ip HOST" in capsys.readouterr().err


def test_a_ray_started_by_serve_offers_every_pool_at_its_largest():
    config = ServeConfig.from_yaml(GPU_CLUSTER)  # 1..4 replicas of one unit each
    assert ray_up.single_node_resources(config) == {"prefill_gpu": 4, "decode_gpu": 4}
    values = {"pools": {"prefill": {"replicas": 0}, "decode": {"replicas": 0}}}
    values["pools"]["mixed"] = {"replicas": 2, "resources": {"any_gpu": 0.5}}
    assert ray_up.single_node_resources(ServeConfig.from_dict(values)) == {"any_gpu": 1.0}
