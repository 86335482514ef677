"""Shared test policy.

GPU tests carry the `gpu` marker and skip with a reason when there is no usable GPU. On
the device we run with REQUIRE_GPU=1, which turns every such skip into a failure, so a
"green" GPU run can never be one where nothing ran.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_GPU = os.environ.get("REQUIRE_GPU", "") not in ("", "0")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[type-arg]
    """With REQUIRE_GPU=1 a skipped GPU test is reported as failed, with the skip reason."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_GPU and report.skipped and item.get_closest_marker("gpu") is not None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"REQUIRE_GPU=1 but this GPU test skipped: {reason}"
