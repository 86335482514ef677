"""Shared test policy.

GPU tests carry the `gpu` marker and skip with a reason when there is no usable GPU. On
the device we run with REQUIRE_GPU=1, which turns every such skip into a failure, so a
"green" GPU run can never be one where nothing ran.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REQUIRE_GPU = os.environ.get("REQUIRE_GPU", "") not in ("", "0")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[type-arg]
    """With REQUIRE_GPU=1 a skipped GPU test is reported as failed, with the skip reason. Every
    report of a phase that made session fixtures carries their seconds (SESSION_SETUP_S)."""
    outcome = yield
    report = outcome.get_result()
    if _session_setup["seconds"]:
        report.user_properties.append((SESSION_SETUP_S, _session_setup["seconds"]))
        _session_setup["seconds"] = 0.0
    if REQUIRE_GPU and report.skipped and item.get_closest_marker("gpu") is not None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"REQUIRE_GPU=1 but this GPU test skipped: {reason}"


# ---------------------------------------------------------------------------------------
# Model and reference fixtures, made once per test run.
#
# The synthetic default model and the reference cases are generated into the run's
# temporary directory (never committed, never downloaded): SPEAKERD_CACHE points there so
# that a server started by a test finds the same default model without regenerating it.
# Under pytest-xdist (`-n 2`, as `make test` runs) each worker is a session of its own; the
# workers share one directory, so the model and the references are made once, by whichever
# worker asks first, under a file lock.
# ---------------------------------------------------------------------------------------


def run_directory(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """`name` in this run's temporary directory, shared by every xdist worker of the run."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-N/popen-gw0 -> pytest-N, the run's
    directory = base / name
    directory.mkdir(exist_ok=True)
    return directory


@contextlib.contextmanager
def made_once(directory: Path) -> Iterator[bool]:
    """Hold `directory`'s lock; yield whether its content still has to be made (then mark it
    made when the block ends without an error)."""
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = directory / ".made"
        make = not done.exists()
        yield make
        if make:
            done.touch()


@pytest.fixture(scope="session")
def speakerd_cache(tmp_path_factory: pytest.TempPathFactory):
    """A private SPEAKERD_CACHE for the run (subprocess servers inherit it; the default
    model in it is made under store.py's own lock)."""
    directory = run_directory(tmp_path_factory, "speakerd-cache")
    previous = os.environ.get("SPEAKERD_CACHE")
    os.environ["SPEAKERD_CACHE"] = str(directory)
    yield directory
    if previous is None:
        os.environ.pop("SPEAKERD_CACHE", None)
    else:
        os.environ["SPEAKERD_CACHE"] = previous


@pytest.fixture(scope="session")
def weights_path(speakerd_cache):
    """The synthetic default model (seed 0), made on first use in the session cache."""
    from speakerd.model.store import default_weights_path

    return default_weights_path()


@pytest.fixture(scope="session")
def segmentation_path(speakerd_cache):
    """The synthetic segmentation model (seed 0), made on first use in the session cache."""
    from speakerd.model.segmentation.store import default_segmentation_path

    return default_segmentation_path()


@pytest.fixture(scope="session")
def folded_model(weights_path):
    """The default model loaded and BatchNorm-folded."""
    from speakerd.model.weights import load_model

    return load_model(weights_path)


@pytest.fixture(scope="session")
def references_dir(tmp_path_factory: pytest.TempPathFactory, weights_path):
    """Every reference case of docs/model.md written by `make-references` for the default model."""
    from speakerd.reference.references import make_references

    directory = run_directory(tmp_path_factory, "references")
    with made_once(directory) as make:
        if make:
            make_references(directory, weights_path)
    return directory


@pytest.fixture(scope="session")
def reference_cases(references_dir):
    """list[ReferenceCase] in CASE_NAMES order (b1 cases with all 38 taps, then mixed_b32)."""
    from speakerd.model.cases import load_cases

    return load_cases(references_dir)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a `slow` test first, each file's tests kept together and in order. Under
    `make test`'s two workers (each takes a whole file, in this order) the long files start
    at once and the short ones fill in after them, instead of one long file starting last
    while the other worker has nothing left to do (test_service.py, unmarked, once started
    last and ran 26 s after the other worker had finished)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within a file stays


#: A test whose setup, call and teardown together take longer than this on CI's 2 cores
#: without the `slow` marker is named at the end of the run: its file belongs with the slow
#: ones that start first (docs/development.md). A report, not a failure: times vary with load.
#: GPU tests are left out: they skip on CI, and the device runs them in one process.
SLOW_TEST_S = 5.0
#: The report's user property: seconds of its phase spent making session fixtures (the
#: default model, the references, the shared server). Whichever test asks first pays them,
#: and waits for the other worker's lock on them, so they are the run's, not the test's.
SESSION_SETUP_S = "session_fixture_setup_s"
_unmarked_seconds: dict[str, float] = {}
_session_setup = {"seconds": 0.0, "depth": 0}


class SessionFixtureTimer:
    """Times the outermost session fixtures made (one made inside another counts once). A
    plugin of its own: pytest calls a session fixture's setup hook on the session node, which
    this directory's conftest hooks do not reach."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef):  # type: ignore[type-arg]
        if fixturedef.scope != "session":
            yield
            return
        _session_setup["depth"] += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            _session_setup["depth"] -= 1
            if _session_setup["depth"] == 0:
                _session_setup["seconds"] += time.perf_counter() - started


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SessionFixtureTimer(), "speakerd-session-fixture-timer")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" not in report.keywords and "gpu" not in report.keywords:
        shared = sum(float(value) for key, value in report.user_properties if key == SESSION_SETUP_S)
        own = report.duration - shared
        _unmarked_seconds[report.nodeid] = _unmarked_seconds.get(report.nodeid, 0.0) + own


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    over = sorted(((s, nodeid) for nodeid, s in _unmarked_seconds.items() if s > SLOW_TEST_S), reverse=True)
    if over:
        terminalreporter.section(f"tests over {SLOW_TEST_S:g} s without the slow marker")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.1f} s {nodeid}")


#: The shared server's plans: b8 keeps a CPU batch near 1 s, so a request spans batches.
SHARED_PLANS = "1,8"


@pytest.fixture(scope="session")
def shared_server(weights_path):
    """One CPU server (`--plans 1,8`) for every module that needs a plain server and no state
    of its own (test_client, test_load_sizing, test_pyannote, test_service): a start costs
    5-15 s of 2 cores (engine build, self-check, plan timing), so each worker starts it once.
    A module whose tests read the log, count metrics without a before/after pair, or change
    the server (flags, a backlog left behind, a cancellation it must find in the log) starts
    its own. It must still have drained and exited 0 at the end of the run."""
    from tests.serving import serve_module

    yield from serve_module(weights_path, "--plans", SHARED_PLANS)
