"""``benchmarks/gpu_clocks.py``: nvidia-smi's samples read and summed up, and a probe
that records nothing where there is no nvidia-smi."""

import time

from benchmarks import gpu_clocks
from benchmarks.gpu_clocks import (
    ClockProbe,
    clocks_now,
    describe,
    limit_reasons,
    limits_text,
    parse_sample,
    smi_device,
    summarize,
)

# Two samples as an H100 answers under load: at its clock, then capped by power.
LINES = (
    "1980, 1980, 2619, 512.33, 61, 0x0000000000000000",
    "1755, 1980, 2619, 699.10, 66, 0x0000000000000004",
)


def test_limit_reasons_names_the_bits():
    assert limit_reasons(0) == []
    assert limit_reasons(0x4) == ["sw power cap"]
    assert limit_reasons(0x41) == ["idle", "hw thermal"]
    assert limit_reasons(0x1000) == ["0x1000"]  # a bit this table does not know


def test_samples_summed_up():
    samples = [parse_sample(line) for line in LINES]
    assert samples[1] == {
        "sm_mhz": 1755.0, "max_sm_mhz": 1980.0, "mem_mhz": 2619.0, "power_w": 699.1,
        "temp_c": 66.0, "reasons": 4,
    }  # fmt: skip
    idle = parse_sample("345, 1980, 2619, 90.0, 40, 0x0000000000000001")
    summary = summarize([*samples, idle])
    assert summary["sm_mhz"] == 1755.0  # the median of 345, 1755, 1980
    assert summary["peak_power_w"] == 699.1 and summary["peak_temp_c"] == 66.0
    assert summary["limits"] == ["sw power cap"]  # idle between timed calls is no limit
    assert summary["samples"] == 3
    assert summarize([]) == {}


def test_a_probe_without_nvidia_smi_records_nothing(monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with ClockProbe(0) as clocks:
        pass
    assert clocks.samples == [] and clocks.summary() == {}


def test_a_probe_samples_an_older_driver_through_its_field_name(tmp_path, monkeypatch):
    """A fake ``nvidia-smi`` that knows only ``clocks_throttle_reasons`` (before 535)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$*" in *clocks_event_reasons*) echo "not a valid field" >&2; exit 2;; esac\n'
        f'echo "{LINES[1]}"\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with ClockProbe(0) as clocks:
        time.sleep(3 * gpu_clocks.PERIOD_S)
    assert any("clocks_throttle_reasons.active" in arg for arg in clocks._query)
    assert len(clocks.samples) >= 3  # at the start, on the thread, at the end
    assert clocks.summary()["limits"] == ["sw power cap"]


def test_the_device_nvidia_smi_names_follows_cuda_visible_devices():
    assert smi_device(0, {}) == "0"
    assert smi_device(1, {"CUDA_VISIBLE_DEVICES": "3,5"}) == "5"
    assert smi_device(0, {"CUDA_VISIBLE_DEVICES": "GPU-8f2e, GPU-11aa"}) == "GPU-8f2e"


def test_a_summary_in_one_line_and_in_a_cell():
    summary = summarize([parse_sample(line) for line in LINES])
    assert describe(summary) == "SM 1868 MHz of 1980, peak 699 W, limits: sw power cap"
    assert limits_text(summary) == "sw power cap"
    assert limits_text({**summary, "limits": []}) == "none"
    assert limits_text({}) == "-"
    assert describe({}) == "SM clock not sampled"


def _fake_smi(tmp_path, line: str) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "{line}"\n')
    smi.chmod(0o755)


def test_clocks_now_is_one_sample(tmp_path, monkeypatch):
    _fake_smi(tmp_path, LINES[0])
    monkeypatch.setenv("PATH", str(tmp_path))
    now = clocks_now(0)
    assert (now["sm_mhz"], now["samples"], now["limits"]) == (1980.0, 1, [])


def test_a_field_that_reads_not_available_is_no_sample(tmp_path, monkeypatch):
    """A GPU without a power reading answers [N/A]: no sample, no exception."""
    _fake_smi(tmp_path, "1980, 1980, 2619, [N/A], 61, 0x0000000000000000")
    monkeypatch.setenv("PATH", str(tmp_path))
    with ClockProbe(0) as clocks:
        pass
    assert clocks.samples == [] and describe(clocks.summary()).startswith("SM clock not")
