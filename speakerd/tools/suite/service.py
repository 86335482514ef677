"""The `service` suite: a server verified and loaded with 32-chunk requests and hour-long
recordings, each load against the engine's own speed in the same run."""

from __future__ import annotations

from speakerd.tools.suite.run import Context
from speakerd.tools.suite.steps import (
    HOUR_S,
    engine_speed,
    load_record,
    references,
    serving_math,
    verify_record,
)

#: The service's load: 16 callers of 32-chunk requests from 4 processes fill the batcher's
#: queue (the requests, not the server, limited fewer), each call one b32 batch.
LOAD_STREAMS, LOAD_CHUNKS, LOAD_PROCESSES = 16, 32, 4
#: On the CPU engine (~8 chunks/s on 2 cores) a load of single chunks shows the service
#: works end to end; its throughput is not a figure anyone quotes.
CPU_LOAD_STREAMS, CPU_LOAD_CHUNKS = 2, 1
#: Receiver processes for the GPU service (docs/service.md: 4 lift FP16 throughput).
RECEIVERS = 4
#: The recording load: two callers of an hour each (one uploads while the other computes),
#: counted for 20 s after a 2 s warm-up; `load` lengthens both to its calls' estimated time.
RECORDING_LOAD = f"--recording {HOUR_S} --streams 2 --warmup 2 --seconds 20 --timeout 100"


def service(ctx: Context) -> None:
    math = serving_math(ctx)
    cpu = ctx.options.engine == "cpu"
    refs = references(ctx)
    ceiling = engine_speed(ctx, math, refs)
    receivers = 0 if cpu else RECEIVERS
    shape = (CPU_LOAD_STREAMS, CPU_LOAD_CHUNKS, 1) if cpu else (LOAD_STREAMS, LOAD_CHUNKS, LOAD_PROCESSES)
    streams, chunks, processes = shape
    seconds = ctx.options.seconds
    serve = f"--engine {ctx.options.engine} --math {math} --receivers {receivers}"
    with ctx.server("service", serve.split()) as server:
        verify_record(ctx, server, refs, math)
        flags = f"--streams {streams} --chunks {chunks} --processes {processes} --seconds {seconds:g}"
        name = f"load {streams}x{chunks} {math} receivers={receivers}"
        for run in range(1, ctx.options.runs + 1):
            load_record(ctx, f"load-{run}", server, flags, seconds + 120, name, "chunks/s", ceiling, run == 1)
        if cpu:
            ctx.skip("recording load", "an hour on the CPU engine takes longer than any budget")
            return
        name = f"load recording 2x{HOUR_S}s {math} receivers={receivers}"
        load_record(ctx, "load-recording", server, RECORDING_LOAD, 170, name, "windows/s", ceiling)
