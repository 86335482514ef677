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


# ---------------------------------------------------------------------------------------
# Model and reference fixtures, made once per test session.
#
# The synthetic default model and the reference cases are generated into a per-session
# temporary directory (never committed, never downloaded): SPEAKERD_CACHE points there so
# that a server started by a test finds the same default model without regenerating it.
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def speakerd_cache(tmp_path_factory: pytest.TempPathFactory):
    """A private SPEAKERD_CACHE for the session (subprocess servers inherit it)."""
    directory = tmp_path_factory.mktemp("speakerd-cache")
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

    directory = tmp_path_factory.mktemp("references")
    make_references(directory, weights_path)
    return directory


@pytest.fixture(scope="session")
def reference_cases(references_dir):
    """list[ReferenceCase] in CASE_NAMES order (b1 cases with all 38 taps, then mixed_b32)."""
    from speakerd.model.cases import load_cases

    return load_cases(references_dir)
