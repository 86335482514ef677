"""`python -m speakerd.tools.bench_voiceprints`: Identify's search, timed against its floor.

Fills a VoiceprintIndex with N random unit voiceprints of one tenant (100,000 x 256 float32
is 100 MB) and times `search` for Q query rows with top-k (what Identify runs), beside:
- `matmul_s`: the score matrix alone (Q x N dot products): the brute-force floor of any
  exact search, which an approximate index would have to beat;
- `read_s`: one pass over the voiceprint matrix (its sum), the memory-bandwidth floor of
  reading 100 MB once, whatever the arithmetic.
Prints one JSON object; each time is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from speakerd.model.architecture import EMBEDDING_DIM
from speakerd.serving.voiceprints.index import VoiceprintIndex
from speakerd.serving.voiceprints.records import VoiceprintRecord


def _median_s(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def run(voiceprints: int, queries: int, top_k: int, repeats: int, seed: int = 0) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    vectors = _unit(rng.standard_normal((voiceprints, EMBEDDING_DIM), dtype=np.float32))
    index = VoiceprintIndex()
    started = time.perf_counter()
    index.reset([VoiceprintRecord("t", f"{i:032x}", f"speaker-{i}", "m", vectors[i], 10.0, 1.0, 1, 0)
                 for i in range(voiceprints)])  # fmt: skip
    load_s = time.perf_counter() - started
    rows = _unit(rng.standard_normal((queries, EMBEDDING_DIM), dtype=np.float32))
    found = index.search("t", "m", rows, top_k)
    best = np.argmax(rows @ vectors.T, axis=1)  # the exact answer, to check the search against
    assert [ids[0] for ids in found.ids] == [f"{i:032x}" for i in best]
    search_s = _median_s(lambda: index.search("t", "m", rows, top_k), repeats)
    matmul_s = _median_s(lambda: rows @ vectors.T, repeats)
    read_s = _median_s(vectors.sum, repeats)
    return {
        "voiceprints": voiceprints,
        "queries": queries,
        "dim": EMBEDDING_DIM,
        "top_k": top_k,
        "matrix_mb": round(vectors.nbytes / 1e6, 1),
        "index_load_s": round(load_s, 3),
        "search_s": round(search_s, 4),
        "queries_per_s": round(queries / search_s),
        "matmul_s": round(matmul_s, 4),
        "read_s": round(read_s, 4),
        "search_over_matmul": round(search_s / matmul_s, 2),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speakerd.tools.bench_voiceprints", description=__doc__)
    parser.add_argument("--voiceprints", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=1_000)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.voiceprints, args.queries, args.top_k, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
