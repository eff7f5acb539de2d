"""``splitserve render``: the serve config written as a Ray Serve config file (and Helm
values) deploys the same serve config ``splitserve serve`` loads."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from splitserve.cluster import render
from splitserve.cluster.app import serve_application
from splitserve.cluster.cli import main
from splitserve.cluster.serve_config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs" / "serve").rglob("*.yaml"))


def _no_key(values: dict) -> dict:
    values["engine"]["kv_transfer"]["auth_key"] = None
    return values


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """``splitserve render ARGS`` in this process: its status, stdout and stderr."""
    try:
        status = main(["render", *args])
    except SystemExit as e:  # argparse
        status = e.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_renders_the_application_the_cli_deploys(path):
    config = ServeConfig.from_yaml(path)
    (app,) = render.serve_config_file(config)["applications"]
    # What the file carries is YAML: write it and read it back, as serve deploy would.
    app = yaml.safe_load(yaml.safe_dump(app))
    cli = serve_application(config)  # what splitserve serve and scale deploy
    assert {**app, "args": None} == yaml.safe_load(yaml.safe_dump({**cli, "args": None}))
    rendered = ServeConfig.from_dict(app["args"]).to_dict()
    assert _no_key(rendered) == _no_key(ServeConfig.from_dict(cli["args"]).to_dict())
    # The file is what `serve deploy` and KubeRay accept: Ray Serve's own schema.
    ServeDeploySchema(**render.serve_config_file(config))


def test_args_hold_changes_pool_placement_and_no_key():
    config = ServeConfig.from_dict(
        {
            "engine": {"kv_transfer": {"max_message_mb": None}, "cache": {"block_size": 32}},
            "pools": {"prefill": {"resources": {"prefill_gpu": 1}}, "decode": {}},
            "http": {"proxy": "serve"},
        }
    )
    args = render.app_args(config)
    assert args["engine"] == {"kv_transfer": {"max_message_mb": None}, "cache": {"block_size": 32}}
    assert args["http"] == {"proxy": "serve"}
    assert args["pools"]["prefill"] == {
        "replicas": 1,
        "min_replicas": None,
        "max_replicas": None,
        "num_gpus": None,
        "resources": {"prefill_gpu": 1},
    }
    assert (args["host"], args["port"], args["app_name"]) == ("127.0.0.1", 8000, "splitserve")
    assert "router" not in args  # unchanged sections stay out
    rebuilt = ServeConfig.from_dict(args)
    assert rebuilt.engine.kv_transfer.max_message_mb is None
    assert rebuilt.engine.kv_transfer.auth_key != config.engine.kv_transfer.auth_key


def test_render_cli_writes_the_serve_config_file(tmp_path, capsys):
    path = ROOT / "configs" / "serve" / "default.yaml"
    status, out, _ = _main(capsys, "--target", "serve-config", str(path))
    assert status == 0
    written = yaml.safe_load(out)
    assert written == render.serve_config_file(ServeConfig.from_yaml(path))
    assert written["http_options"] == {"host": "127.0.0.1", "port": 8000}
    (app,) = written["applications"]
    assert (app["name"], app["route_prefix"]) == ("splitserve", "/")
    assert app["import_path"] == "splitserve.cluster.app:app_builder"

    out = tmp_path / "values.yaml"
    assert _main(capsys, "--target", "helm", "-o", str(out), str(path))[0] == 0
    assert yaml.safe_load(out.read_text()) == {"application": app}


def test_bad_render_input_is_refused_with_the_reason(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  prefill: {resources: {GPU: 1}}\n")
    status, _, err = _main(capsys, "--target", "helm", str(bad))
    assert status == 2 and "bad.yaml: invalid pools.prefill.resources.GPU" in err
    status, _, err = _main(capsys, "--target", "yaml", str(bad))
    assert status == 2 and "invalid choice: 'yaml'" in err
    with pytest.raises(ValueError, match="invalid --host 'prefill': must be POOL=HOST"):
        render.parse_hosts(["prefill"])
    args = argparse.Namespace(target="ray-up", launch=None, provider="azure")
    with pytest.raises(ValueError, match="unknown provider 'azure'; accepted: local, aws, gcp"):
        render.render(ServeConfig(), args)
