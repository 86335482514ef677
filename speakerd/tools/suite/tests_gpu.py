"""The `tests-gpu` suite: every GPU test file with REQUIRE_GPU=1, one record per file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from speakerd.tools.suite.record import figure
from speakerd.tools.suite.run import Context, StepFailed, shown

#: Run last: its bit-for-bit checks of every one-kernel block entry point take the longest.
LAST_TEST_FILE = "test_gpu_block.py"
#: Not marked `gpu` (it compiles every kernel with NVRTC, no GPU needed) but run here too:
#: on the device it compiles with the device's own CUDA, beside the GPU engine's tests.
EXTRA_TEST_FILES = ("test_kernels_compile.py",)
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def gpu_test_files(repo: Path) -> list[Path]:
    """Every test file carrying the `gpu` marker, plus EXTRA_TEST_FILES; LAST_TEST_FILE last."""
    tests = repo / "tests"
    marked = [path for path in sorted(tests.glob("test_*.py")) if "pytest.mark.gpu" in path.read_text()]
    marked = [path for path in marked if not path.name.startswith("test_pyannote")]  # the pyannote suite's
    extra = [tests / name for name in EXTRA_TEST_FILES if (tests / name).exists()]
    files = sorted({*marked, *extra})
    return sorted(files, key=lambda path: path.name == LAST_TEST_FILE)


def pytest_counts(text: str) -> dict[str, Any]:
    """passed/failed/... counts from pytest's last summary line, and the FAILED test ids."""
    summary = [line for line in text.splitlines() if _PYTEST_COUNT.search(line) and " in " in line]
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for number, kind in _PYTEST_COUNT.findall(summary[-1] if summary else ""):
        counts["errors" if kind.startswith("error") else kind] = int(number)
    counts["failed_tests"] = [
        line.split()[1] for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))
    ]
    return counts


def tests_gpu(ctx: Context) -> None:
    files = gpu_test_files(ctx.repo)
    if not files:
        ctx.skip("tests-gpu", f"no GPU test files under {ctx.repo / 'tests'}")
        return
    failed = []
    for path in files:
        if ctx.left() < 30:
            ctx.skip(path.name, f"{ctx.left():.0f} s left of the suite's budget")
            continue
        argv = ctx.python(
            "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", str(path.relative_to(ctx.repo))
        )
        try:
            done = ctx.run(path.stem, argv, ctx.left(), env={"REQUIRE_GPU": "1"}, check=False)
        except StepFailed as error:
            ctx.say(str(error))
            failed.append(path.name)
            continue
        counts = pytest_counts(done.stdout)
        ok = done.returncode == 0
        ctx.record(
            path.name,
            shown(argv),
            figure(counts["passed"], "tests passed", "higher"),
            detail={**counts, "exit": done.returncode},
            ok=ok,
            headline=True,
        )
        if not ok:
            failed.append(path.name)
            for test in counts["failed_tests"]:
                ctx.say(f"FAILED {test}")
    if failed:
        raise StepFailed(f"failed: {', '.join(failed)}")
