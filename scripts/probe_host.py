"""Experiment: what the interpreter lock costs the batcher, without the network.

One FP16 GPU engine; `bench --batcher`'s load (16 callers of 32 chunks, in process) run
under each (switch interval, lock pressure) pair. Lock pressure stands in for grpc.aio's
receive of 10 MB requests on the event-loop thread: a thread that copies a 10 MB bytes
object (memcpy with the lock held, as the receive does) RATE times a second. Prints one
JSON line per pair.

    python scripts/probe_host.py [RATE]
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speakerd.engine.gpu.engine import GpuEngine
from speakerd.model.cases import case_inputs
from speakerd.model.numerics import Math, pad_speakers
from speakerd.model.store import default_weights_path
from speakerd.model.weights import load_model
from speakerd.tools.bench_batcher import bench

#: A 32-chunk request's fbank on the wire: 32 x 998 x 80 float32.
REQUEST_BYTES = 32 * 998 * 80 * 4


def pressure(rate: float, stop: threading.Event, copies: list[float]) -> None:
    """Copy REQUEST_BYTES with the lock held `rate` times a second until `stop`."""
    source = bytearray(REQUEST_BYTES)
    period, next_at = 1.0 / rate, time.perf_counter()
    while not stop.is_set():
        began = time.perf_counter()
        bytes(source)  # one memcpy, lock held
        copies.append(time.perf_counter() - began)
        next_at += period
        time.sleep(max(0.0, next_at - time.perf_counter()))


def main() -> None:
    rate = float(sys.argv[1]) if len(sys.argv) > 1 else 200.0
    engine = GpuEngine(load_model(default_weights_path()), Math.FP16, (1, 32))
    fbank, masks = case_inputs("mixed_b32")
    masks = pad_speakers(masks)
    try:
        for switch_ms in (5.0, 0.5):
            for with_pressure in (False, True):
                sys.setswitchinterval(switch_ms / 1e3)
                stop, copies = threading.Event(), []
                worker = threading.Thread(target=pressure, args=(rate, stop, copies), daemon=True)
                if with_pressure:
                    worker.start()
                line = bench(engine, fbank, masks, 16, 8.0)
                stop.set()
                if with_pressure:
                    worker.join()
                line.update(pressure_copies_per_s=round(len(copies) / 8.0, 1) if with_pressure else 0,
                            pressure_copy_ms=round(1e3 * sum(copies) / max(len(copies), 1), 3))  # fmt: skip
                print(json.dumps(line), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
