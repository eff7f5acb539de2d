"""The pure parts of the benchmark helpers: tables, reports, plots, and the floors' arithmetic."""

import json
import math
import sys

import pytest
import torch

from benchmarks import kernels_roofline as kr
from benchmarks import roofline
from benchmarks.roofline import (
    device_slug,
    format_cell,
    format_table,
    plot_ratios,
    print_table,
    write_report,
)

BF16 = torch.bfloat16


def test_format_cell():
    assert format_cell(None) == "-"
    assert format_cell(0.81234) == "0.8123"
    assert format_cell(3352.7) == "3353"
    assert format_cell(0.000123456) == "0.0001235"
    assert format_cell(float("nan")) == "nan"
    assert format_cell(4096) == "4096"
    assert format_cell("bf16") == "bf16"


def test_table_is_markdown_with_numbers_right_aligned():
    text = format_table(["dtype", "tokens", "ratio"], [["bf16", 1, 0.5], ["fp8", 16384, None]])
    lines = text.splitlines()
    assert len(lines) == 4
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines[::2] + lines[3:])
    assert lines[0].split("|")[1:-1] == [" dtype ", " tokens ", " ratio "]
    assert lines[1] == "|-------|-------:|------:|"  # text left, numbers right
    assert lines[2] == "| bf16  |      1 |   0.5 |"
    assert lines[3] == "| fp8   |  16384 |     - |"
    assert len({len(line) for line in lines}) == 1


def test_table_refuses_a_short_row():
    with pytest.raises(ValueError, match="2 cells, the table 3"):
        format_table(["a", "b", "c"], [[1, 2]])


def test_print_table(capsys):
    print_table(["a"], [[1.0]])
    assert capsys.readouterr().out == "| a |\n|--:|\n| 1 |\n"


def test_write_report_creates_parents_and_nulls_nan(tmp_path):
    path = tmp_path / "deep" / "er" / "report.json"
    write_report(path, {"rows": [{"ms": 1.5, "ratio": float("nan")}], "inf": float("inf")})
    text = path.read_text()
    assert text.endswith("\n") and "\n  " in text  # indented
    assert json.loads(text) == {"rows": [{"ms": 1.5, "ratio": None}], "inf": None}


def test_device_slug():
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert device_slug("NVIDIA H200") == "nvidia-h200"
    assert device_slug("  ") == "unknown"


def test_plot_ratios_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plots" / "ratios.png"
    plot_ratios(path, ["a", "b", "c"], [0.5, 0.9, math.nan], "test", target=0.8)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_ratios_checks_lengths(tmp_path):
    with pytest.raises(ValueError, match="2 labels for 1 ratios"):
        plot_ratios(tmp_path / "x.png", ["a", "b"], [1.0], "test")


# ---- the floors of benchmarks/kernels_roofline.py ----------------------------------


def test_kv_store_bytes_count_the_read_and_the_cache_dtype_write():
    rows = 16384 * 8 * 128  # Qwen3-8B: 8 KV heads x 128, one layer
    assert kr.kv_store_bytes(16384, 8, 128, BF16, BF16) == 2 * rows * (2 + 2)
    assert kr.kv_store_bytes(16384, 8, 128, BF16, torch.float8_e4m3fn) == 2 * rows * (2 + 1)
    assert kr.kv_store_bytes(0, 8, 128, BF16, BF16) == 0


def test_moe_floor_counts_each_distinct_expert_once():
    one = 3 * 2048 * 768 * 2  # w13 [1536, 2048] + w2 [2048, 768], bf16
    assert kr.expert_bytes(2048, 768, BF16) == one
    ids = torch.tensor([[3, 7], [7, 1], [3, 1]])
    assert kr.moe_weight_bytes(ids, 2048, 768, BF16) == 3 * one
    all_experts = torch.arange(128).view(16, 8)
    assert kr.moe_weight_bytes(all_experts, 2048, 768, BF16) == 128 * one  # ~1.2 GB
    assert kr.moe_flops(256, 8, 2048, 768) == 2 * 256 * 8 * one // 2


def test_floor_is_the_slower_of_memory_and_compute():
    assert kr.floor_ms(2e9, 2000.0) == pytest.approx(1.0)  # 2 GB at 2 TB/s
    assert kr.floor_ms(2e9, 2000.0, flops=1e12, tflops=500.0) == pytest.approx(2.0)
    assert kr.floor_ms(2e9, 2000.0, flops=1e9, tflops=500.0) == pytest.approx(1.0)


def test_elementwise_bytes():
    assert kr.rmsnorm_residual_bytes(4096, 4096, BF16) == (4 * 4096 + 1) * 4096 * 2
    # q (2 heads) and k (1 head) of dim 4 read and written in bf16; cos and sin float32
    assert kr.rotary_bytes(3, 2, 1, 4, 4, BF16) == 2 * 3 * 3 * 4 * 2 + 2 * 3 * 4 * 4
    assert kr.qk_norm_rope_bytes(3, 2, 1, 4, BF16) == kr.rotary_bytes(3, 2, 1, 4, 4, BF16) + 16
    assert kr.silu_and_mul_bytes(4096, 4096, BF16) == 3 * 4096 * 4096 * 2


def test_scattered_slots_are_distinct_and_in_the_cache():
    blocks = kr.kv_cache_blocks(100, 16)
    assert blocks == 4 * 7 + 1
    slots = kr.scattered_slots(100, blocks * 16, torch.Generator().manual_seed(0))
    assert slots.dtype == torch.int64 and slots.shape == (100,)
    assert slots.unique().numel() == 100
    assert int(slots.min()) >= 0 and int(slots.max()) < blocks * 16
    assert not torch.equal(slots, slots.sort().values)  # scattered, not in order
    with pytest.raises(ValueError, match="101 tokens do not fit 100 slots"):
        kr.scattered_slots(101, 100, torch.Generator())


def test_rel_err_and_check_refuse_wrong_and_nan_outputs(capsys):
    ref = torch.tensor([1.0, -2.0, 4.0])
    assert kr.rel_err(ref.clone(), ref) == 0.0
    assert kr.rel_err(ref + torch.tensor([0.0, 0.4, 0.0]), ref) == pytest.approx(0.1)
    assert math.isnan(kr.rel_err(torch.tensor([1.0, math.nan, 4.0]), ref))
    assert math.isnan(kr.rel_err(ref, torch.zeros(3)))  # an all-zero reference proves nothing
    assert math.isnan(kr.rel_err(ref[:2], ref))
    assert kr.check("ok", 0.01) == 0.01
    with pytest.raises(kr.KernelMismatch, match="relative error 0.1 > 0.02"):
        kr.check("wrong", 0.1)
    with pytest.raises(kr.KernelMismatch):
        kr.check("nan", math.nan)
    assert "check wrong: relative error 0.1 (> 0.02)" in capsys.readouterr().out


def test_show_prints_every_column_and_the_errors(capsys):
    rows = [
        {"tokens": 1, "experts": 8, "bytes": 75e6, "mb": 75.5, "ms": 0.05, "ratio_to_floor": 0.5},
        {"tokens": 256, "error": "KernelMismatch: fused_moe 256 tokens: relative error 1"},
    ]
    kr.show("moe", rows)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| tokens"))
    assert header.count("|") == len(kr.SECTIONS["moe"][1]) + 1
    assert "| 75.5 |" in out.replace("  ", " ")
    assert "not timed: KernelMismatch: fused_moe 256 tokens" in out


def test_fp8_far_apart_allows_one_step():
    scale = torch.tensor([0.5])
    b = torch.tensor([1.0, 2.0, 4.0, 0.0]) * scale
    assert kr.fp8_far_apart(b.clone(), b, scale) == 0.0
    one_step = torch.tensor([1.125, 2.0, 4.0, 0.0]) * scale  # e4m3: 3 mantissa bits
    assert kr.fp8_far_apart(one_step, b, scale) == 0.0
    two_steps = torch.tensor([1.0, 2.5, 4.0, 0.0]) * scale
    assert kr.fp8_far_apart(two_steps, b, scale) == 0.25


def test_command_line_drops_the_report_path(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["x", "--sweep", "--json", "/tmp/out.json", "--quick"])
    assert roofline.command_line("k.py") == "python benchmarks/k.py --sweep --json --quick"
    monkeypatch.setattr(sys, "argv", ["x", "--json", "--quick"])
    assert roofline.command_line("k.py") == "python benchmarks/k.py --json --quick"


def test_evict_l2_refuses_an_unknown_way():
    with pytest.raises(ValueError, match="'read' or 'write'"):
        roofline.evict_l2(torch.ones(8, dtype=torch.uint8), by="flush")


def test_back_to_back_needs_calls():
    with pytest.raises(ValueError, match="at least one call"):
        roofline.time_cuda_ms_back_to_back([])


def test_kernel_times_name_the_ops_a_call_runs():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    times = roofline.kernel_times_us(lambda: torch.mm(a, b).relu_(), repeat=3, device_type="CPU")
    assert {"aten::mm", "aten::relu_"} <= set(times)
    assert all(us > 0 for us in times.values())
    assert roofline.kernel_times_us(lambda: None, repeat=3, device_type="CPU") == {}
