"""A real ``ray up`` of cluster/launch/local.yaml on this machine, serving the embedded
default, then ``ray down``.

An sshd on 127.0.0.1:22 (Debian's openssh-server, installed with apt-get when missing,
a key made here) runs in its own PID and mount namespace, so that what ``ray up`` starts
through it (and the ``ray stop`` of ``ray up`` and ``ray down``) sees only its own
processes and its own /tmp/ray: other Ray instances of the machine are untouched. The
launch YAML is ``splitserve render --target ray-up --provider local`` of the default
config with its pools placed by ``resources`` (prefill_gpu, decode_gpu, both on the
head); for this machine the test logs in as root with its key, checks splitserve is
installed instead of installing it, and gives Ray free ports. ``splitserve serve
--address auto`` deploys through ``ray exec``; a completion must equal the offline
engine's; after ``ray down`` nothing may run in the namespace but sshd.

Needs root, apt-get (or sshd and rsync installed) and port 22 free; about two minutes.
Not in the default run: ``python -m pytest tests/test_launch_ray_up.py -m launch -s``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from splitserve.cluster import ray_up
from splitserve.cluster.ports import free_port
from splitserve.cluster.serve_command import default_config_path
from splitserve.cluster.serve_config import ServeConfig

pytestmark = [pytest.mark.launch, pytest.mark.slow]

HOST = "127.0.0.1"
SSHD = Path("/usr/sbin/sshd")
RAY = Path(sys.executable).parent / "ray"
BOOTSTRAP_FILES = [Path.home() / "ray_bootstrap_config.yaml", Path.home() / "ray_bootstrap_key.pem"]


# Each custom resource of the cluster: [total, available].
HELD_RESOURCES = (
    'python -c \'import json, ray; ray.init(address="auto", log_to_driver=False); '
    "total, free = ray.cluster_resources(), ray.available_resources(); "
    'print(json.dumps({k: [total[k], free.get(k, 0.0)] for k in ("prefill_gpu", "decode_gpu")}))\''
)


def _ensure_sshd_and_rsync() -> None:
    if SSHD.exists() and shutil.which("rsync"):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("needs openssh-server and rsync, and root with apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "openssh-server", "rsync"],
    ):
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)


class Transcript:
    """Every command and its output, printed as it goes (``-s`` shows it)."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, text: str) -> None:
        print(text, end="" if text.endswith("\n") else "\n", flush=True)
        with open(self.path, "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def run(self, *cmd: str, timeout: float = 600, check: bool = True) -> str:
        self.write(f"$ {' '.join(cmd)}")
        # No usage stats from the cluster (ray up passes the setting on to the nodes).
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out = proc.stdout + proc.stderr
        self.write(out)
        if check:
            assert proc.returncode == 0, f"{cmd[:3]} exited {proc.returncode}:\n{out[-3000:]}"
        return out


@contextlib.contextmanager
def namespaced_sshd(workdir: Path):
    """sshd on 127.0.0.1:22 in a PID and mount namespace of its own (private /tmp/ray and
    /tmp/haproxy-serve); yields the client's private key."""
    with socket.socket() as s:
        if s.connect_ex((HOST, 22)) == 0:
            pytest.skip("port 22 is taken: the local provider connects to ssh's port")
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to keep the cluster's processes apart")
    key, host_key = workdir / "id_ed25519", workdir / "host_ed25519"
    for path in (key, host_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True)
    (workdir / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    config = workdir / "sshd_config"
    config.write_text(
        f"ListenAddress {HOST}\nPort 22\nHostKey {host_key}\n"
        f"AuthorizedKeysFile {workdir / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "StrictModes no\nPidFile none\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    private = "/tmp/ray /tmp/haproxy-serve"
    script = (
        f"mkdir -p {private} && for d in {private}; do mount -t tmpfs tmpfs $d; done && "
        f"exec {SSHD} -D -e -f {config}"
    )
    with open(workdir / "sshd.log", "w") as log:
        sshd = subprocess.Popen(
            [
                "unshare",
                "--pid",
                "--mount",
                "--fork",
                "--mount-proc",
                "--kill-child",
                "sh",
                "-c",
                script,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 10
        while socket.socket().connect_ex((HOST, 22)) != 0:
            assert sshd.poll() is None, (workdir / "sshd.log").read_text()
            assert time.monotonic() < deadline, "sshd did not listen"
            time.sleep(0.1)
        yield key
    finally:
        # --kill-child: the namespace's first process (sshd) dies with unshare, and the
        # kernel ends every other process of the namespace with it.
        sshd.kill()
        sshd.wait(timeout=30)


def _ssh(key: Path, command: str) -> subprocess.CompletedProcess:
    opts = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    cmd = ["ssh", "-q", "-i", str(key), *opts, f"root@{HOST}", command]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _serve_config(workdir: Path, port: int) -> Path:
    """The embedded default, each pool placed through its own custom resource."""
    values = yaml.safe_load(default_config_path().read_text())
    values["pools"]["prefill"]["resources"] = {"prefill_gpu": 1}
    values["pools"]["decode"]["resources"] = {"decode_gpu": 1}
    values["port"] = port
    path = workdir / "serve.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _launch_yaml(workdir: Path, serve_config: Path, key: Path) -> Path:
    config = ServeConfig.from_yaml(serve_config)
    base = ray_up.load_base(ray_up.base_path("local"))
    hosts = {"prefill": [HOST], "decode": [HOST]}
    launch = ray_up.render_ray_up(config, base, hosts, HOST)
    # This machine: root through the test's sshd; splitserve is installed already (the
    # shipped setup commands install it from the checkout); other Ray instances run
    # here, so Ray and HAProxy take free ports.
    launch["cluster_name"] = f"splitserve-test-{os.getpid()}"
    launch["auth"] = {"ssh_user": "root", "ssh_private_key": str(key)}
    launch["file_mounts"] = {}
    launch["setup_commands"] = [f"{sys.executable} -c 'import splitserve.cluster.app'"]
    ports = (
        f"--port={free_port(HOST)} --dashboard-port={free_port(HOST)} "
        f"--ray-client-server-port={free_port(HOST)} "
        f"--dashboard-agent-listen-port={free_port(HOST)}"
    )
    haproxy = (
        f"export RAY_SERVE_HAPROXY_STATS_PORT={free_port(HOST)}; "
        f"export RAY_SERVE_HAPROXY_METRICS_PORT={free_port(HOST)}; "
    )
    head = launch["head_start_ray_commands"]
    assert f"--port={ray_up.RAY_PORT}" in head[-1] and "prefill_gpu" in head[-1]
    head[-1] = haproxy + head[-1].replace(f"--port={ray_up.RAY_PORT}", ports)
    path = workdir / "cluster.yaml"
    path.write_text(yaml.safe_dump(launch, sort_keys=False))
    return path


def _wait_until_served(serve_log: Path, port: int, timeout: float) -> None:
    """Until ``splitserve serve`` says it serves on ``port`` (another server of the
    machine may have taken a port picked free a moment before: then this fails)."""
    deadline = time.monotonic() + timeout
    while f"at http://{HOST}:{port}/v1" not in serve_log.read_text():
        assert "splitserve serve:" not in serve_log.read_text(), serve_log.read_text()  # errors
        assert time.monotonic() < deadline, (
            f"not serving after {timeout} s:\n{serve_log.read_text()}"
        )
        time.sleep(2)


def _completion(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    assert resp.status == 200, raw
    return json.loads(raw)


@pytest.fixture
def head_home_restored():
    """ray up copies its bootstrap config and key to the head's home: here, this one."""
    there = [p for p in BOOTSTRAP_FILES if p.exists()]
    yield
    for path in BOOTSTRAP_FILES:
        if path not in there:
            path.unlink(missing_ok=True)


def test_ray_up_serves_the_default_and_ray_down_leaves_nothing(tmp_path, head_home_restored):
    _ensure_sshd_and_rsync()
    log = Transcript(tmp_path / "transcript.txt")
    port = free_port(HOST)
    serve_config = _serve_config(tmp_path, port)
    with namespaced_sshd(tmp_path) as key:
        cluster = _launch_yaml(tmp_path, serve_config, key)
        log.write(f"# {cluster.name}:\n{cluster.read_text()}")
        try:
            started = time.monotonic()
            log.run(str(RAY), "up", "-y", "--no-config-cache", str(cluster))
            log.write(f"# ray up took {time.monotonic() - started:.0f} s")
            serve_log, pid_file = tmp_path / "serve.log", tmp_path / "serve.pid"
            deploy = (
                f"setsid nohup splitserve serve --address auto --config {serve_config} "
                f"> {serve_log} 2>&1 < /dev/null & echo $! > {pid_file}"
            )
            log.run(str(RAY), "exec", str(cluster), deploy)
            body = {
                "prompt": "Hello world",
                "max_tokens": 8,
                "temperature": 0,
                "return_token_ids": True,
            }
            _wait_until_served(serve_log, port, timeout=300)
            resp = _completion(port, body)
            assert resp["model"] == "qwen3-tiny", resp  # this server, not another one's
            log.write(f"# POST /v1/completions {json.dumps(body)}\n{json.dumps(resp)}")
            log.write(f"# {serve_log.name}:\n{serve_log.read_text()}")
            (choice,) = resp["choices"]
            from splitserve import LLM, SamplingParams

            offline = LLM("qwen3-tiny", dtype="float32", device="cpu").generate(
                resp["prompt_token_ids"],
                SamplingParams(max_tokens=8, temperature=0),
                use_tqdm=False,
            )[0]
            assert choice["token_ids"] == offline.outputs[0].token_ids
            assert choice["finish_reason"] == "length"
            # Each pool's replica holds its node's custom resource.
            held = log.run(str(RAY), "exec", str(cluster), HELD_RESOURCES)
            assert '{"prefill_gpu": [1.0, 0.0], "decode_gpu": [1.0, 0.0]}' in held, held

            log.run(str(RAY), "exec", str(cluster), f"kill -TERM $(cat {pid_file})")
            deadline = time.monotonic() + 120
            while _ssh(key, f"kill -0 $(cat {pid_file})").returncode == 0:
                assert time.monotonic() < deadline, serve_log.read_text()
                time.sleep(1)
            log.write(f"# {serve_log.name} after SIGTERM:\n{serve_log.read_text()[-600:]}")
        finally:
            log.run(str(RAY), "down", "-y", str(cluster), check=False)
        processes = _ssh(key, "ps -eo pid,comm,args").stdout
        log.write(f"# after ray down, in the cluster's namespace:\n{processes}")
        names = {line.split()[1] for line in processes.splitlines()[1:]}
        assert names <= {"sshd", "bash", "sh", "ps"}, processes
        with socket.socket() as s:
            assert s.connect_ex((HOST, port)) != 0, "the HTTP port still answers"
