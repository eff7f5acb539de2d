"""The SLO attainment map of ``serve_bench.py`` reports (DistServe's figure).

    python benchmarks/slo_grid.py REPORT.json[.gz] [REPORT2 ...]
        --ttft-ms 200 500 1000 --tpot-ms 6 8 10 12 15 25 [--share 0.9] [--json OUT]

For each config and each (TTFT SLO, TPOT SLO) pair: the highest open-loop rate
swept at which ``--share`` of the sent requests met both SLOs, from each rate
point's per-request records (its median run, the run behind its summary), the
test the benchmark's goodput uses (``serve_load.meets_slo``). A table per config
(rows: TPOT SLO, columns: TTFT SLO) and one of the first config's rate over the
second's (PD against colocated when given in that order; ``--ratio A B`` picks the
pair by config label). A rate that passes at
the highest rate swept is a lower bound (``>=``; ``capped`` in the JSON). The
load is the reports' workload, printed above the tables (random token ids: a
simulated load shape).

Several reports form one curve per config label: a sweep split across runs (rates
4-12 in one file, 16-28 in another) is merged by rate. When two files have the
same rate for the same label, the later file on the command line wins (a re-run
replaces the earlier point); the output says which file each rate came from and
which it replaced. Configs are ordered by first appearance.
"""

from __future__ import annotations

import argparse
from pathlib import Path

try:
    import roofline
    import serve_report
except ImportError:  # imported as benchmarks.slo_grid (the tests)
    from benchmarks import roofline, serve_report


def merge(reports: list[tuple[str, dict]]) -> dict:
    """One report of the rate points of ``(name, report)`` pairs, by config label; a
    point's ``source`` is its file's name, a later file's point replaces an earlier one
    at the same rate (listed in ``replaced``)."""
    curves: dict[str, dict[float, dict]] = {}
    replaced = []
    for name, report in reports:
        for config in report["configs"]:
            curve = curves.setdefault(config["label"], {})
            for point in serve_report.rate_points(config):
                rate = point["value"]
                if rate in curve:
                    replaced.append(
                        f"{config['label']} rate {rate:g}: {name} replaces {curve[rate]['source']}"
                    )
                curve[rate] = {**point, "source": name}
    workloads = list(dict.fromkeys(report["workload"] for _, report in reports))
    configs = [{"label": label, "points": list(c.values())} for label, c in curves.items()]
    workload = workloads[0] if len(workloads) == 1 else f"differing: {'; '.join(workloads)}"
    return {"workload": workload, "configs": configs, "replaced": replaced}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("reports", type=Path, nargs="+", help="serve_bench.py --json files")
    p.add_argument("--ttft-ms", type=float, nargs="+", required=True, help="TTFT SLOs (columns)")
    p.add_argument("--tpot-ms", type=float, nargs="+", required=True, help="TPOT SLOs (rows)")
    p.add_argument("--share", type=float, default=serve_report.GOOD_SHARE, help="attained at")
    p.add_argument(
        "--ratio",
        nargs=2,
        metavar=("A", "B"),
        help="the ratio table of config A's rate over B's (default: the first two configs)",
    )
    p.add_argument("--json", type=Path, help="write the grid here (gzipped for .gz)")
    args = p.parse_args(argv)
    if not 0 < args.share <= 1:
        p.error(f"--share {args.share}: must be in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    merged = merge([(str(path), serve_report.read_json(path)) for path in args.reports])
    ratio_of = tuple(args.ratio) if args.ratio else None
    try:
        grid = serve_report.slo_grid(merged, args.ttft_ms, args.tpot_ms, args.share, ratio_of)
    except ValueError as e:
        raise SystemExit(f"slo_grid.py: {e}") from None
    grid["replaced"] = merged["replaced"]
    for line in merged["replaced"]:
        print(f"{line} (the later file wins)")
    serve_report.print_slo_grid(grid)
    if args.json:
        grid["command"] = roofline.command_line("slo_grid.py", ("--json",))
        grid["reports"] = [str(path) for path in args.reports]
        serve_report.write_json(args.json, grid)
    return grid


if __name__ == "__main__":
    main()
