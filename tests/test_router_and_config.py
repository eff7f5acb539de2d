"""Route choice, replica ranking, autoscaling decisions and deployment-config checks."""

from __future__ import annotations

import pytest

from splitserve.cluster import routing
from splitserve.cluster.routing import RouterConfig, WorkerLoad
from splitserve.cluster.serve_command import default_config_path
from splitserve.cluster.serve_config import ServeConfig
from splitserve.workers.engine.messages import WorkerStats


def test_routes_follow_prompt_length_and_pools():
    cfg = RouterConfig(local_prompt_tokens=32)
    assert routing.choose_route(cfg, 32, True, True, False) == routing.LOCAL_SHORT
    assert routing.choose_route(cfg, 33, True, True, False) == routing.DISAGGREGATED
    assert routing.choose_route(cfg, 10, True, True, True) == routing.LOCAL_MIXED
    assert routing.choose_route(cfg, 500, True, True, True) == routing.DISAGGREGATED
    assert routing.choose_route(cfg, 500, False, True, True) == routing.LOCAL_MIXED
    with pytest.raises(ValueError, match="no worker can serve"):
        routing.choose_route(cfg, 500, True, False, False)


def test_a_prefill_backlog_sends_long_prompts_to_a_less_loaded_decode_worker():
    """Conditional disaggregation: once every prefill worker has the threshold queued, a
    long prompt is computed where less prompt work waits; short prompts are unchanged."""
    cfg = RouterConfig(local_prompt_tokens=32, prefill_backlog_tokens=8192)

    def route(n, prefill_backlog, decode_backlog=0, mixed=False):
        return routing.choose_route(cfg, n, True, True, mixed, prefill_backlog, decode_backlog)

    assert route(2048, 8191) == routing.DISAGGREGATED
    assert route(2048, 8192) == routing.LOCAL_BACKLOG
    assert route(2048, 9000, decode_backlog=9000) == routing.DISAGGREGATED  # no better there
    assert route(16, 9000) == routing.LOCAL_SHORT
    assert route(16, 9000, mixed=True) == routing.LOCAL_MIXED
    never = RouterConfig(prefill_backlog_tokens=None)
    assert routing.choose_route(never, 2048, True, True, False, 10**9) == routing.DISAGGREGATED
    with pytest.raises(ValueError, match="prefill_backlog_tokens=0: must be an integer >= 1"):
        RouterConfig(prefill_backlog_tokens=0).check()


def test_replica_ranking_uses_live_load():
    cfg = RouterConfig()
    idle = WorkerLoad(queued_prompt_tokens=0, num_free_blocks=10)
    busy = WorkerLoad(queued_prompt_tokens=4000, num_free_blocks=100)
    assert routing.prefill_cost(idle, 0) < routing.prefill_cost(busy, 0)
    assert routing.prefill_cost(idle, 5000) > routing.prefill_cost(busy, 0)  # routed, unreported
    light = WorkerLoad(num_running=2, kv_usage=0.5)
    heavy = WorkerLoad(num_running=9, kv_usage=0.5)
    full = WorkerLoad(num_running=0, kv_usage=0.99)
    ranked = sorted([full, heavy, light], key=lambda w: routing.decode_cost(cfg, w, 0))
    assert ranked == [light, heavy, full]
    stats = WorkerStats("decode", 1, num_running=3, num_sending_kv=2, kv_usage=0.5)
    load = WorkerLoad.from_stats(stats)
    assert (load.num_running, load.num_requests, load.kv_usage) == (3, 5, 0.5)
    assert WorkerLoad.from_stats(None) == WorkerLoad()


def test_shipped_configs_load():
    config = ServeConfig.from_yaml(default_config_path())
    assert config.engine.device == "cpu" and config.port == 8000
    assert config.pools["prefill"].replicas == 1 and config.pools["decode"].replicas == 1
    assert not config.pools["mixed"].active


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"pools": {"decode": {"max_replica": 2}}}, "key 'pools.decode.max_replica'"),
        ({"pools": {"prefil": {}}}, "unknown pool 'prefil'"),
        ({"router": {"local_prompt_token": 3}}, "unknown config key 'router.local_prompt_token'"),
        ({"engine": {"cache": {"blocksize": 8}}}, "unknown config key 'cache.blocksize'"),
        ({"engine": {"role": "both"}}, "invalid role='both'"),
        ({"engine": {"kv_transfer": {"transport": "rdma"}}}, "kv_transfer.transport='rdma'"),
        ({"engine": {"kv_transfer": {"lanes": 0}}}, "kv_transfer.lanes=0: must be an integer"),
        ({"engine": {"kv_transfer": {"layers_per_message": "8"}}}, "layers_per_message='8'"),
        ({"engine": {"kv_transfer": {"first_message_layers": True}}}, "first_message_layers=True"),
        ({"engine": {"kv_transfer": {"max_message_mb": 0}}}, "max_message_mb=0: must be"),
        ({"engine": {"kv_transfer": {"max_ctas": 0}}}, "kv_transfer.max_ctas=0: must be"),
        ({"pools": {"decode": {"min_replicas": 1}}}, "set both min_replicas and max_replicas"),
        ({"pools": {"decode": {"replicas": 0}}}, "no worker can serve"),
        ({"router": {"local_prefix_hit_ratio": 0}}, "local_prefix_hit_ratio=0"),
        ({"port": 0}, "invalid port=0"),
        ({"pools": {"decode": {"max_queued_requests": 0}}}, "pools.decode.max_queued_requests=0"),
        ({"pools": {"prefill": {"max_ongoing_requests": 0}}}, "max_ongoing_requests=0"),
        ({"hosts": "x"}, "unknown config key 'hosts'"),
        ({"engine": {"scheduler": {"async_scheduling": "yes"}}}, "async_scheduling='yes'"),
        ({"pools": {"decode": {"stall_timeout_s": 0}}}, "pools.decode.stall_timeout_s=0"),
        (
            {"pools": {"mixed": {"replicas": 1, "watchdog_timeout_s": 1.0}}},
            "pools.mixed.watchdog_timeout_s=1.0: must be >= stall_timeout_s=2.0",
        ),
        (
            {"pools": {"decode": {"step_timeout_s": 5.0}}},
            "pools.decode.step_timeout_s=5.0: must be >= watchdog_timeout_s=10.0",
        ),
        ({"drain_timeout_s": -1}, "invalid drain_timeout_s=-1"),
    ],
)
def test_bad_configs_name_the_key(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("'", "'")):
        ServeConfig.from_dict(values)


def test_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("pools:\n  decode: {replicas: -1}\n")
    with pytest.raises(ValueError, match=r"bad.yaml: invalid pools.decode.replicas=-1"):
        ServeConfig.from_yaml(path)


def test_the_kv_message_byte_cap_can_be_lifted():
    config = ServeConfig.from_dict({"engine": {"kv_transfer": {"max_message_mb": None}}})
    assert config.engine.kv_transfer.nccl_options()["max_message_bytes"] is None
    config = ServeConfig.from_dict({"engine": {"kv_transfer": {"max_message_mb": 32}}})
    assert config.engine.kv_transfer.nccl_options()["max_message_bytes"] == 32 << 20


def test_the_nccl_thread_block_cap_reaches_the_transport():
    assert ServeConfig.from_dict({}).engine.kv_transfer.nccl_options()["max_ctas"] is None
    config = ServeConfig.from_dict({"engine": {"kv_transfer": {"max_ctas": 16}}})
    assert config.engine.kv_transfer.nccl_options()["max_ctas"] == 16


def test_ingress_config_is_checked_and_builds_its_deployment():
    from splitserve.cluster.app import ingress_deployment
    from splitserve.cluster.serve_config import ServeConfig

    fixed = ServeConfig.from_dict({"ingress": {"replicas": 3}})
    assert ingress_deployment(fixed).num_replicas == 3
    scaled = ServeConfig.from_dict({"ingress": {"min_replicas": 1, "max_replicas": 4}})
    autoscaling = ingress_deployment(scaled)._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 4)
    assert autoscaling.target_ongoing_requests == 256
    with pytest.raises(ValueError, match="unknown config key 'ingress.replica'"):
        ServeConfig.from_dict({"ingress": {"replica": 2}})
    with pytest.raises(ValueError, match="ingress: set both min_replicas and max_replicas"):
        ServeConfig.from_dict({"ingress": {"min_replicas": 1}})
    with pytest.raises(ValueError, match="invalid ingress.replicas=0"):
        ServeConfig.from_dict({"ingress": {"replicas": 0}})


def test_metrics_sum_every_ingress_replica():
    from splitserve.cluster.metrics import INGRESS, ServingMetrics
    from splitserve.workers.engine.messages import WorkerStats

    blocks = {"num_free_blocks": 1, "num_blocks": 2, "kv_usage": 0.5}
    mine, other = ServingMetrics(), ServingMetrics()
    mine.requests.labels("disaggregated", "ok").inc(2)
    other.requests.labels("disaggregated", "ok").inc(3)
    other.ttft.labels("local_short").observe(0.02)
    snapshot = {
        "ingress-b": (INGRESS, {"samples": other.samples()}),
        "ingress-a": (INGRESS, {"samples": []}),  # this replica's stale post: not counted
        "w1": ("decode", WorkerStats("decode", 8, pid=7, num_running=4, **blocks).as_dict()),
    }
    text = mine.render(snapshot, "ingress-a").decode()
    assert 'splitserve_requests_total{outcome="ok",route="disaggregated"} 5.0' in text
    assert 'splitserve_time_to_first_token_seconds_count{route="local_short"} 1.0' in text
    assert 'splitserve_pool_replicas{pool="decode"} 1.0' in text
    assert 'pool="ingress"' not in text


def test_a_prompt_goes_before_its_ticket_only_where_the_blocks_are_free():
    # 64 prompt tokens in blocks of 16 need 4 blocks; 32 tokens sent since the report, 2 more
    assert routing.reserves_at_once(4, 64, 0, 16)
    assert not routing.reserves_at_once(3, 64, 0, 16)
    assert not routing.reserves_at_once(5, 64, 32, 16)
    assert routing.reserves_at_once(6, 64, 32, 16)
    assert routing.reserves_at_once(1, 1, 0, 16)  # a part block takes a whole one


def test_prefill_before_ticket_is_a_router_switch():
    assert RouterConfig().prefill_before_ticket
    with pytest.raises(ValueError, match="prefill_before_ticket"):
        RouterConfig(prefill_before_ticket="yes").check()
