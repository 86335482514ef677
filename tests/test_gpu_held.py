"""The CUDA calls that enqueue a batch with the interpreter lock kept (engine/gpu/held.py).

What a newcomer should read here: on a GPU the driver's functions load; copies in every
direction, event records, stream waits and graph launches made through them do what
CuPy's calls do; and, the reason they exist, a thread that wants the interpreter lock
gets no step while a run of them is made, whereas one CuPy call already hands it the lock
(the control that shows this test can fail). The engine's own tests (test_gpu_engine.py
and the others) run every batch through these calls.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from tests.test_gpu_engine import GPU_DETAIL, GPU_USABLE

needs_gpu = pytest.mark.skipif(not GPU_USABLE, reason=f"no usable GPU for the CuPy engine: {GPU_DETAIL}")
#: Switch interval while the lock is watched: far longer than the held calls take (~1 ms
#: for CALLS), so a waiting thread only runs if a call lets the lock go.
WATCH_SWITCH_S = 0.5
#: Held calls made while watching.
CALLS = 200
#: How long the control keeps making CuPy copies: each lets the lock go for a few
#: microseconds and the waiting thread runs only if it wakes inside one, so one copy alone is
#: a coin toss; tens of thousands are not. Well inside WATCH_SWITCH_S, after which the waiting
#: thread would be handed the lock whether or not a call let it go.
CONTROL_S = WATCH_SWITCH_S / 5


@pytest.mark.gpu
@needs_gpu
def test_driver_calls_load_and_move_bytes_every_way() -> None:
    import cupy

    from speakerd.engine.gpu import held
    from speakerd.engine.gpu.staging import pinned

    assert held.AVAILABLE, f"{held.DRIVER_LIBRARY}: not loaded with every function on a GPU machine"
    held.bind(cupy.cuda.Device().id)
    stream = cupy.cuda.Stream(non_blocking=True)
    values = np.arange(4096, dtype=np.float32)
    host_in, host_out = pinned(values.shape, np.float32), pinned(values.shape, np.float32)
    host_in[:] = values
    host_out[:] = -1
    first, second = cupy.empty(values.shape, cupy.float32), cupy.empty(values.shape, cupy.float32)
    uploaded = cupy.cuda.Event(block=True)
    held.copy(first.data.ptr, host_in.ctypes.data, values.nbytes, stream)  # host -> device
    held.record(uploaded, stream)
    other = cupy.cuda.Stream(non_blocking=True)
    held.wait(other, uploaded)  # the device -> device copy runs on another stream, after it
    held.copy(second.data.ptr, first.data.ptr, values.nbytes, other)
    held.copy(host_out.ctypes.data, second.data.ptr, values.nbytes, other)  # device -> host
    done = cupy.cuda.Event(block=True)
    held.record(done, other)
    done.synchronize()
    assert np.array_equal(host_out, values), "bytes changed on the way host -> device -> device -> host"


@pytest.mark.gpu
@needs_gpu
def test_a_graph_launched_through_the_driver_replays_it() -> None:
    import cupy

    from speakerd.engine.gpu import held

    held.bind(cupy.cuda.Device().id)
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.arange(1024, dtype=cupy.float32)
    with stream:
        stream.begin_capture()
        x *= 2
        graph = stream.end_capture()
        graph.launch(stream)  # CuPy instantiates it on its first launch
        for _ in range(3):
            held.launch(graph, stream)
    stream.synchronize()
    expected = np.arange(1024, dtype=np.float32) * 16
    assert graph.graphExec, "the graph was not instantiated"
    assert np.array_equal(cupy.asnumpy(x), expected), "four replays must double x four times"


def _steps_while(work) -> int:
    """Steps a thread waiting for the interpreter lock makes while `work(steps)` runs (`steps`:
    the waiting thread's count so far, one item)."""
    steps, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            steps[0] += 1

    spinner = threading.Thread(target=spin, daemon=True)
    interval = sys.getswitchinterval()
    # set first: a thread waiting for the lock asks for it after the interval in force when
    # its wait began, so both this thread's wait below and the spinner's later one use it
    sys.setswitchinterval(WATCH_SWITCH_S)
    spinner.start()
    time.sleep(0.01)  # the spinner runs; this thread gets the lock back after the interval
    try:
        before = steps[0]
        work(steps)
        return steps[0] - before
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        spinner.join()


@pytest.mark.gpu
@needs_gpu
def test_held_calls_keep_the_interpreter_lock(capsys) -> None:
    import cupy

    from speakerd.engine.gpu import held

    held.bind(cupy.cuda.Device().id)
    stream = cupy.cuda.Stream(non_blocking=True)
    a, b = cupy.zeros(256, cupy.float32), cupy.zeros(256, cupy.float32)
    event = cupy.cuda.Event()

    def held_calls() -> None:
        for _ in range(CALLS):
            held.copy(b.data.ptr, a.data.ptr, a.nbytes, stream)
            held.record(event, stream)

    cupy_calls = [0]

    def cupy_calls_until_the_waiter_runs(steps: list[int]) -> None:
        runtime = cupy.cuda.runtime
        before, end = steps[0], time.perf_counter() + CONTROL_S
        while steps[0] == before and time.perf_counter() < end:
            runtime.memcpyAsync(b.data.ptr, a.data.ptr, a.nbytes, runtime.memcpyDefault, stream.ptr)
            cupy_calls[0] += 1

    held_steps = _steps_while(lambda steps: held_calls())
    cupy_steps = _steps_while(cupy_calls_until_the_waiter_runs)
    stream.synchronize()
    with capsys.disabled():
        print(f"\nsteps of a thread waiting for the lock: {held_steps} during {2 * CALLS} held calls, "
              f"{cupy_steps} during {cupy_calls[0]} CuPy copies")  # fmt: skip
    assert held_steps == 0, f"a waiting thread ran {held_steps} steps during held calls: one let the lock go"
    assert cupy_steps > 0, (
        f"control: CuPy's copy lets the lock go, so the waiting thread must have run during "
        f"{cupy_calls[0]} copies in {CONTROL_S} s"
    )
