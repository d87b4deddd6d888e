"""What the GPU's clocks and power did during a benchmark: a summary table and a plot.

    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,\
clocks_event_reasons.active --format=csv -lms 100 > telemetry.csv &   # while the benchmark runs
    python benchmarks/diffusion/gpu_telemetry.py telemetry.csv --max-sm-mhz 1980 --plot telemetry.png

Samples with utilization >= `--busy-pct` are the busy ones. For them the table gives the SM clock
(median, 10th and 90th percentile, against `--max-sm-mhz`), the power draw, and how often each clock
event reason was active: a GPU held at its power limit ("SW power cap") runs its kernels at whatever
clock that power allows, so kernel times measured in short bursts are faster than in a long run.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import Column, format_table, get_pyplot, percentile  # noqa: E402

EVENT_REASONS = {
    0x1: "GPU idle",
    0x2: "application clocks setting",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake",
}
"""nvidia-smi's `clocks_event_reasons.active` bits (`nvidia-smi --help-query-gpu`)."""


@dataclass(frozen=True)
class Sample:
    seconds: float
    """Since the first sample."""
    sm_mhz: int
    power_w: float
    util_pct: int
    reasons: int


def _number(cell: str) -> float:
    return float(cell.strip().split()[0])


def read_samples(path: str | Path) -> list[Sample]:
    """nvidia-smi CSV rows (header from the query above; `reasons` optional) -> samples; rows that do
    not parse (a '[N/A]' field, a truncated last line) are skipped."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = [h.strip() for h in rows[0]]
    col = {name: i for i, name in enumerate(header)}
    reason_col = next((i for name, i in col.items() if "reasons" in name), None)
    samples, t0 = [], None
    for row in rows[1:]:
        try:
            stamp = datetime.strptime(row[col["timestamp"]].strip(), "%Y/%m/%d %H:%M:%S.%f")
            sm = int(_number(row[col["clocks.current.sm [MHz]"]]))
            power = _number(row[col["power.draw [W]"]])
            util = int(_number(row[col["utilization.gpu [%]"]]))
            reasons = int(row[reason_col].strip(), 16) if reason_col is not None else 0
        except (ValueError, IndexError, KeyError):
            continue
        t0 = stamp if t0 is None else t0
        samples.append(Sample((stamp - t0).total_seconds(), sm, power, util, reasons))
    return samples


def summarize(samples: list[Sample], max_sm_mhz: float, busy_pct: int) -> dict:
    busy = [s for s in samples if s.util_pct >= busy_pct]
    if not busy:
        return {"num_samples": len(samples), "num_busy": 0}
    clocks = [s.sm_mhz for s in busy]
    summary = {
        "num_samples": len(samples),
        "num_busy": len(busy),
        "sm_mhz_median": statistics.median(clocks),
        "sm_mhz_p10": percentile(clocks, 10),
        "sm_mhz_p90": percentile(clocks, 90),
        "sm_pct_of_max": 100 * statistics.median(clocks) / max_sm_mhz,
        "power_w_median": statistics.median(s.power_w for s in busy),
        "power_w_max": max(s.power_w for s in busy),
    }
    summary["reasons_pct"] = {
        name: 100 * sum(bool(s.reasons & bit) for s in busy) / len(busy)
        for bit, name in EVENT_REASONS.items()
        if any(s.reasons & bit for s in busy)
    }
    return summary


def plot(samples: list[Sample], path: str | Path, max_sm_mhz: float, power_limit_w: float | None) -> Path:
    plt = get_pyplot()
    fig, (ax_clock, ax_power) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    t = [s.seconds for s in samples]
    ax_clock.plot(t, [s.sm_mhz for s in samples], lw=0.8, label="SM clock")
    ax_clock.axhline(max_sm_mhz, color="grey", ls="--", lw=0.8, label=f"max {max_sm_mhz:.0f} MHz")
    capped = [s.seconds for s in samples if s.reasons & 0x4]
    if capped:
        ax_clock.scatter(capped, [max_sm_mhz * 1.02] * len(capped), s=2, color="red", label="SW power cap")
    ax_clock.set_ylabel("MHz")
    ax_clock.legend(loc="lower right", fontsize=8)
    ax_power.plot(t, [s.power_w for s in samples], lw=0.8, color="tab:orange", label="power draw")
    if power_limit_w:
        ax_power.axhline(power_limit_w, color="grey", ls="--", lw=0.8, label=f"limit {power_limit_w:.0f} W")
    ax_power.set_ylabel("W")
    ax_power.set_xlabel("seconds")
    ax_power.legend(loc="lower right", fontsize=8)
    fig.suptitle("GPU clocks and power during the benchmark (nvidia-smi, 100 ms samples)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", help="nvidia-smi --format=csv output (query in the module docstring)")
    parser.add_argument("--max-sm-mhz", type=float, default=1980.0, help="clocks.max.sm (H200: 1980)")
    parser.add_argument("--power-limit-w", type=float, default=None, help="power.limit, drawn on the plot")
    parser.add_argument("--busy-pct", type=int, default=90, help="utilization that counts as busy")
    parser.add_argument("--plot", default=None, help="write the PNG here")
    args = parser.parse_args(argv)
    samples = read_samples(args.csv)
    summary = summarize(samples, args.max_sm_mhz, args.busy_pct)
    keys = ("sm_mhz_median", "sm_mhz_p10", "sm_mhz_p90", "sm_pct_of_max", "power_w_median", "power_w_max")
    columns = [Column("num_busy", "busy samples")] + [Column(k, k.replace("_", " "), ".0f") for k in keys]
    print(format_table([summary], columns))
    for name, pct in summary.get("reasons_pct", {}).items():
        print(f"  {name}: active in {pct:.0f} % of busy samples")
    if args.plot:
        print(f"wrote {plot(samples, args.plot, args.max_sm_mhz, args.power_limit_w)}")
    return summary


if __name__ == "__main__":
    main()
