"""serving/memory/heap.py: a server process keeps the memory its requests free (glibc's malloc).

What a newcomer should read here: a process that again and again holds two 32-chunk
requests' worth of bytes at once and frees them (what receiving a gRPC message and copying
it out does) faults those pages in on every cycle with glibc's defaults (the control: else
this test would test nothing), and never again with `keep_freed_memory`. Each case runs in
a fresh interpreter, so this test's own heap does not decide the outcome.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from speakerd.model.architecture import FRAMES, MEL_BINS

#: One 32-chunk request's fbank, the size the servers' receive buffers have.
REQUEST_BYTES = 32 * FRAMES * MEL_BINS * 4
CYCLES = 20
PAGE_BYTES = 4096
#: Faults per cycle allowed with the setting: a tenth of the buffer's pages (the interpreter's
#: own small allocations fault a few pages now and then).
MAX_FAULTS_PER_CYCLE = REQUEST_BYTES // PAGE_BYTES // 10

CHILD = """
import json, resource, sys
if sys.argv[1] == "keep":
    from speakerd.serving.memory.heap import keep_freed_memory
    applied = keep_freed_memory()
else:
    applied = None
size, cycles = int(sys.argv[2]), int(sys.argv[3])
def cycle():
    # a message's bytes and the copy made of them, alive together, then both freed
    # (gRPC's receive path holds the slices and the bytes object at once)
    message = b"\\x01" * size
    copy = message + b"\\x02"
    del message, copy
cycle()  # the first one faults in whatever happens
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(cycles):
    cycle()
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({"applied": applied, "faults_per_cycle": (after - before) / cycles}))
"""


def _faults(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(REQUEST_BYTES), str(CYCLES)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


def test_freed_request_buffers_are_reused_not_faulted_in_again(capsys) -> None:
    kept = _faults("keep")
    if not kept["applied"]:
        pytest.skip("this malloc is not glibc's (no mallopt): keep_freed_memory changes nothing here")
    default = _faults("default")
    pages = REQUEST_BYTES // PAGE_BYTES
    default_faults, kept_faults = default["faults_per_cycle"], kept["faults_per_cycle"]
    with capsys.disabled():
        print(f"\nminor faults per cycle of two {REQUEST_BYTES / 1e6:.1f} MB buffers ({pages} pages each): "
              f"default {default_faults:.0f}, keep_freed_memory {kept_faults:.0f}")  # fmt: skip
    assert default_faults > pages, (
        f"control: {default_faults:.0f} faults per cycle by default, the case reproduces nothing"
    )
    assert kept_faults <= MAX_FAULTS_PER_CYCLE, (
        f"{kept_faults:.0f} faults per cycle with freed memory kept, expected at most "
        f"{MAX_FAULTS_PER_CYCLE}: the buffer was faulted in again"
    )


FREEZE_CHILD = """
import gc, json
from speakerd.serving.memory import heap
kept = [[i] for i in range(200_000)]  # what a start-up leaves: long-lived (tracked) objects
gc.collect()
before = len(gc.get_objects(generation=2))
frozen = heap.freeze_long_lived()
print(json.dumps({"before": before, "after": len(gc.get_objects(generation=2)), "frozen": frozen}))
"""


def test_start_up_objects_leave_the_full_collections() -> None:
    """After `freeze_long_lived`, a full collection no longer walks what the start-up left
    (here 200,000 lists standing in for the model and engine): they are frozen, not in
    the oldest generation, which is what a full pass (and its pause) scales with."""
    done = subprocess.run([sys.executable, "-c", FREEZE_CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout)
    print(counts)
    assert counts["before"] >= 200_000, f"control: the objects were not in generation 2: {counts}"
    assert counts["frozen"] >= 200_000 and counts["after"] < 1_000, counts
