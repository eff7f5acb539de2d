"""The pure parts of the benchmark helpers: tables, reports, plots, and the floors' arithmetic."""

import json
import math

import pytest

from benchmarks.roofline import (
    device_slug,
    format_cell,
    format_table,
    plot_ratios,
    print_table,
    write_report,
)


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
