"""``splitserve serve`` checks what it can in the driver before deploying: a checkpoint with
a shorter context than the config asks for is served at its own, and an error that can be
known beforehand reaches the terminal once, with its cause and a non-zero status."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

import pytest
import torch

from splitserve.cluster import ports
from splitserve.cluster.serve_command import load_config
from splitserve.cluster.startup_checks import fit_to_model, last_cause
from tests import checkpoints


def _args(**kwargs) -> argparse.Namespace:
    fields = dict(
        config=None, model=None, prefill=None, decode=None, mixed=None, host=None, port=None,
        device=None, address=None, api_key=None,
    )  # fmt: skip
    return argparse.Namespace(**{**fields, **kwargs})


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory):
    path = checkpoints.write_qwen3(tmp_path_factory.mktemp("short-context"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    return path


def test_a_model_with_a_shorter_context_is_served_at_its_own(short_context_model):
    config = load_config(_args(model=str(short_context_model)))
    assert config.engine.scheduler.max_model_len == 1024  # the default config's
    notes = fit_to_model(config)
    assert config.engine.scheduler.max_model_len == 256
    assert notes == [
        "max_model_len 1024 is beyond the model's context (max_position_embeddings=256); "
        "serving with max_model_len 256"
    ]
    assert config.to_dict()["engine"]["scheduler"]["max_model_len"] == 256


def test_what_the_driver_can_know_it_checks(short_context_model, tmp_path):
    config = load_config(_args(model=str(short_context_model)))
    config.engine.cache.num_kv_blocks = 8
    with pytest.raises(ValueError, match="num_kv_blocks=8 cannot hold one request of max_model"):
        fit_to_model(config)
    config.engine.cache.num_kv_blocks = None
    config.engine.device = "cuda"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
            fit_to_model(config, local=True)
    fit_to_model(config, local=False)  # joining a cluster: its GPUs are not this machine's
    (tmp_path / "config.json").write_text((short_context_model / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        fit_to_model(load_config(_args(model=str(tmp_path))))


def test_the_api_key_comes_from_the_flag_then_the_environment(monkeypatch):
    assert load_config(_args()).http.api_key is None
    monkeypatch.setenv("SPLITSERVE_API_KEY", "from-env")
    assert load_config(_args()).http.api_key == "from-env"
    assert load_config(_args(api_key="from-flag")).http.api_key == "from-flag"


def _serve_refused(*flags: str) -> str:
    """``splitserve serve FLAGS`` exits 2 before Ray starts, with one line and no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "splitserve.cluster.cli", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stdout
    return lines[0]


def test_a_bad_model_fails_before_ray_starts_with_one_line(tmp_path):
    assert "is a directory without config.json" in _serve_refused("--model", str(tmp_path))


def test_a_port_in_use_fails_before_ray_starts_with_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _serve_refused("--port", str(port))
    assert f"127.0.0.1:{port} is in use" in line and "pass --port" in line


def test_a_port_left_in_time_wait_is_free():
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server's side closes first: its end waits in TIME_WAIT
        client.close()
        assert ports.in_use("127.0.0.1", port)  # still listening
    assert not ports.in_use("127.0.0.1", port)


def test_a_replica_failure_is_told_by_its_cause():
    text = (
        "The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n"
        '  File "x.py", line 1, in f\nray.exceptions.RayTaskError(ValueError): ray::Replica\n'
        "ValueError: device 'cuda' was asked for, but torch sees no CUDA GPU; use --device cpu"
    )
    assert last_cause(text) == (
        "ValueError: device 'cuda' was asked for, but torch sees no CUDA GPU; use --device cpu"
    )
    assert last_cause("Failed to update the deployments ['prefill']") == (
        "Failed to update the deployments ['prefill']"
    )


def test_a_failed_deployment_prints_its_cause_once_and_exits_1(monkeypatch, capsys):
    """serve_main around a deploy that fails as Ray Serve's does when a replica's
    constructor keeps raising: the cause from serve.status(), one line, status 1, and the
    app is still torn down."""
    import ray
    from ray import serve

    from splitserve.cluster import app, serve_command

    cause = "ValueError: device 'cuda' was asked for, but torch sees no CUDA GPU"
    deployment = argparse.Namespace(
        status="DEPLOY_FAILED",
        message=f"failed 3 times.\nTraceback (most recent call last):\n{cause}",
    )
    status = argparse.Namespace(
        applications={"splitserve": argparse.Namespace(deployments={"decode": deployment})}
    )
    calls = []

    def failing_deploy(*args, **kwargs):
        raise RuntimeError(
            "Deploying application splitserve failed: "
            "Failed to update the deployments ['prefill', 'decode']."
        )

    node = {"Alive": True, "Resources": {"CPU": 2.0}}
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append("init"))
    monkeypatch.setattr(ray, "nodes", lambda: [node])
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(serve, "start", lambda **kw: None)
    monkeypatch.setattr(app, "deploy", failing_deploy)
    monkeypatch.setattr(serve, "status", lambda: status)
    monkeypatch.setattr(serve, "delete", lambda name: calls.append("delete"))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(serve_command, "_remove_stats_board", lambda name: None)
    assert serve_command.serve_main(_args()) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "failed" in line] == [
        f"splitserve serve: the deployment failed: {cause}"
    ]
    assert calls == ["init", "delete", "serve.shutdown", "ray.shutdown"]


def test_the_stream_interval_comes_from_the_command_line_and_is_checked():
    from splitserve.cluster.serve_command import add_parsers

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    assert load_config(parser.parse_args(["serve"])).engine.scheduler.stream_interval == 1
    config = load_config(parser.parse_args(["serve", "--stream-interval", "8"]))
    assert config.engine.scheduler.stream_interval == 8
    with pytest.raises(ValueError, match="invalid stream_interval=0: must be an integer >= 1"):
        load_config(parser.parse_args(["serve", "--stream-interval", "0"]))
