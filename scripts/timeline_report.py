"""Read a timeline written by scripts/serve_timeline.py and print, as JSON lines, where each
batch's time went (ms: mean, p50, p90, p99, max per step), the device gaps (how many and
how long those over 2 ms were), the garbage collections over 5 ms, and the steady rate
between two moments (seconds after the first batch).

    python scripts/timeline_report.py timeline.json[.gz] [--steady 0.5 9.5]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np

STEPS = {
    "formed -> thread start": ("formed", "thread_start"),
    "thread start -> run_batch": ("thread_start", "run_start"),
    "run_batch": ("run_start", "run_end"),
    "run_batch end -> thread end": ("run_end", "thread_end"),
    "thread end -> loop resumed": ("thread_end", "resumed"),
}
#: A gap longer than this is a stall, not the ~20 us between back-to-back graph replays.
STALL_S = 0.002
#: Collections longer than this are listed.
LONG_GC_S = 0.005


def summary(values: list[float]) -> dict[str, float]:
    ms = np.asarray(values) * 1e3
    stats = {"mean": ms.mean(), "p50": np.percentile(ms, 50), "p90": np.percentile(ms, 90)}
    stats |= {"p99": np.percentile(ms, 99), "max": ms.max()}
    return {key: round(float(value), 3) for key, value in stats.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--steady", type=float, nargs=2, default=(0.5, 9.5), metavar=("FROM_S", "TO_S"))
    args = parser.parse_args()
    opener = gzip.open if args.timeline.suffix == ".gz" else open
    with opener(args.timeline, "rt") as file:
        timeline = json.load(file)
    batches = [b for b in timeline["batches"] if "run_end" in b and "resumed" in b]
    first = batches[0]["formed"]
    for step, (start, end) in STEPS.items():
        print(json.dumps({"step": step, **summary([b[end] - b[start] for b in batches])}))
    for key in ("stage_s", "h2d_s", "compute_s", "gap_s"):
        print(json.dumps({"step": key, **summary([b[key] or 0.0 for b in batches])}))
    stalls = [
        (round(b["formed"] - first, 3), round(1e3 * b["gap_s"], 2))
        for b in batches
        if (b["gap_s"] or 0) > STALL_S
    ]
    stall_ms = round(sum(gap for _, gap in stalls), 1)
    print(json.dumps({"batches": len(batches), "gaps_over_2ms": len(stalls), "gap_ms_over_2ms": stall_ms,
                      "stalls_at_s_ms": stalls}))  # fmt: skip
    collections = timeline["collections"]
    long_ones = [
        (round(s - first, 3), round(1e3 * (e - s), 1), g) for s, e, g in collections if e - s > LONG_GC_S
    ]
    print(json.dumps({"collections": len(collections), "over_5ms_at_s_ms_generation": long_ones}))
    low, high = args.steady
    steady = [b for b in batches if low <= b["formed"] - first < high]
    rate = sum(b["chunks"] for b in steady[1:]) / (steady[-1]["formed"] - steady[0]["formed"])
    compute_ms = 1e3 * np.mean([b["compute_s"] for b in steady])
    gap_ms = 1e3 * np.mean([b["gap_s"] or 0.0 for b in steady])
    print(json.dumps({"steady_from_s": low, "steady_to_s": high, "batches": len(steady),
                      "chunks_per_s": round(rate, 1), "compute_ms_mean": round(float(compute_ms), 3),
                      "gap_ms_mean": round(float(gap_ms), 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
