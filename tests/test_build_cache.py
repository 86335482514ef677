"""The start-up build cache (speakerd.engine.build_cache) keeps a GPU server's choices valid.

What an operator relies on: a start under the same GPU, driver, libraries, model, math,
plan sizes and kernel sources gets the choices the last start stored; any of those changed
and nothing is used, with one line naming what changed; a truncated, edited or foreign file
is never trusted (a WARNING, the file removed, a fresh build); and servers starting at once
on one cache directory never leave or read a partial entry.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
from pathlib import Path

import pytest

from speakerd.engine.build_cache import FORMAT, BuildCache, BuildKey, sources_digest

KEY = BuildKey(
    gpu="NVIDIA H100 80GB HBM3",
    compute_capability="9.0",
    driver="580.159.04",
    cuda="13.2",
    cudnn="91900",
    cudnn_frontend="1.32.0",
    model_id="d854bd8edb94",
    math="fp16",
    plan_sizes=(1, 32),
    conv_kernels="ours",
    kernel_sources=sources_digest([("conv_wgmma.cu", b"// kernel")]),
    speakerd="0.1.0",
)
ENTRIES = {"b32 fp16 layer1.0.conv1": {"runner": "ours", "name": "conv_f16_r3s1_n32_8x32"},
           "b32 fp16 layer3.0.conv1": {"runner": "cudnn", "plan_index": 3, "fused": True}}  # fmt: skip


def test_a_stored_build_is_loaded_under_the_same_key(tmp_path, caplog) -> None:
    cache = BuildCache(tmp_path)
    with caplog.at_level(logging.INFO, "speakerd.engine.build_cache"):
        first = cache.load(KEY)
        assert first.entries is None and "nothing cached" in first.why, first
        cache.store(KEY, ENTRIES)
        again = cache.load(dataclasses.replace(KEY))
    assert again.entries == ENTRIES, again
    assert cache.path(KEY).name == f"{KEY.digest()}.json" and len(KEY.digest()) == 32
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO], caplog.text
    assert list(tmp_path.glob("*.tmp")) == [], "a temporary file was left behind"


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"driver": "580.95.05"}, "driver 580.159.04 -> 580.95.05"),
        ({"gpu": "NVIDIA H200", "compute_capability": "9.0"}, "gpu NVIDIA H100 80GB HBM3 -> NVIDIA H200"),
        ({"plan_sizes": (1, 8, 32)}, "plan_sizes [1, 32] -> [1, 8, 32]"),
        ({"kernel_sources": sources_digest([("conv_wgmma.cu", b"// kernel, edited")])}, "kernel_sources"),
        ({"math": "tf32", "model_id": "0123abcd"}, "model_id d854bd8edb94 -> 0123abcd, math fp16 -> tf32"),
    ],
)
def test_any_change_of_the_key_builds_afresh_saying_what_changed(tmp_path, change, said) -> None:
    cache = BuildCache(tmp_path)
    cache.store(KEY, ENTRIES)
    changed = dataclasses.replace(KEY, **change)
    loaded = cache.load(changed)
    assert loaded.entries is None, loaded
    assert said in loaded.why and "closest cached build differs" in loaded.why, loaded.why
    assert cache.load(KEY).entries == ENTRIES, "the other key's entry must stay"


def _rewrite(path: Path, edit) -> None:
    path.write_text(edit(path.read_text()))


CORRUPTIONS = {
    "truncated": lambda text: text[: len(text) // 2],
    "empty": lambda text: "",
    "a choice edited": lambda text: text.replace("conv_f16_r3s1_n32_8x32", "conv_f16_r3s1_n32_1x128"),
    "another format": lambda text: text.replace(FORMAT, "speakerd.build/0"),
    "not an object": lambda text: "[1, 2, 3]",
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_entry_is_never_trusted_and_is_rebuilt(tmp_path, caplog, corruption) -> None:
    cache = BuildCache(tmp_path)
    path = cache.store(KEY, ENTRIES)
    _rewrite(path, CORRUPTIONS[corruption])
    with caplog.at_level(logging.INFO, "speakerd.engine.build_cache"):
        loaded = cache.load(KEY)
    assert loaded.entries is None and "is corrupt" in loaded.why, (corruption, loaded)
    assert any(r.levelno == logging.WARNING for r in caplog.records), caplog.text
    assert not path.exists(), "a corrupt entry must be removed"
    cache.store(KEY, ENTRIES)
    assert cache.load(KEY).entries == ENTRIES


def test_an_entry_under_another_keys_name_is_not_used(tmp_path) -> None:
    # a file copied or renamed onto this key's name: its key is not this key
    cache = BuildCache(tmp_path)
    other = dataclasses.replace(KEY, driver="575.00")
    cache.path(other).parent.mkdir(parents=True, exist_ok=True)
    cache.store(other, ENTRIES).rename(cache.path(KEY))
    loaded = cache.load(KEY)
    assert loaded.entries is None and "not the key its name stands for" in loaded.why, loaded


def test_the_key_is_json_and_back() -> None:
    fields = json.loads(json.dumps(KEY.fields()))
    assert BuildKey.from_fields(fields) == KEY
    with pytest.raises(KeyError):
        BuildKey.from_fields({**fields, "extra": 1})


def test_sources_digest_changes_with_any_source() -> None:
    sources = [("a.cu", b"one"), ("b.cu", b"two")]
    digest = sources_digest(sources)
    assert sources_digest(list(reversed(sources))) == digest, "the order given must not matter"
    for changed in ([("a.cu", b"one!"), ("b.cu", b"two")], [("a.cu", b"one")],
                    [*sources, ("c.cu", b"")], [("a2.cu", b"one"), ("b.cu", b"two")]):  # fmt: skip
        assert sources_digest(changed) != digest, changed


#: Writers and readers of one entry at once, and how often each writes or reads.
PROCESSES, ROUNDS = 6, 40


def _hammer(directory: str, worker: int) -> list[str]:
    """Store this worker's entries and load, ROUNDS times; what each load found."""
    cache = BuildCache(Path(directory))
    mine = {f"worker {worker} choice {i}": {"runner": "ours", "name": "x" * 400} for i in range(50)}
    found = []
    for _ in range(ROUNDS):
        cache.store(KEY, mine)
        loaded = cache.load(KEY)
        found.append("whole" if loaded.entries is not None and len(loaded.entries) == 50 else loaded.why)
    return found


def test_servers_storing_and_loading_at_once_never_see_a_partial_entry(tmp_path) -> None:
    with multiprocessing.get_context("fork").Pool(PROCESSES) as pool:
        results = pool.starmap(_hammer, [(str(tmp_path), worker) for worker in range(PROCESSES)])
    outcomes = [outcome for found in results for outcome in found]
    bad = [outcome for outcome in outcomes if outcome != "whole"]
    assert not bad, f"{len(bad)} of {len(outcomes)} loads did not get a whole entry: {bad[:3]}"
    assert list(tmp_path.glob("*.tmp")) == [], "temporary files were left behind"
    assert BuildCache(tmp_path).load(KEY).entries is not None


def test_the_cache_lives_where_serve_and_warm_point_it(tmp_path, monkeypatch) -> None:
    """$SPEAKERD_BUILD_CACHE names the folder; serve and warm set it to builds/ in
    $SPEAKERD_CACHE when it is not set, as they do CuPy's and numba's (caches.py)."""
    from speakerd.engine.build_cache import BUILD_CACHE_VARIABLE, BUILDS_DIR, build_cache_dir
    from speakerd.serving.server.caches import START_CACHES, point_start_caches

    monkeypatch.setenv("SPEAKERD_CACHE", str(tmp_path / "cache"))
    environ = {"CUPY_CACHE_DIR": "/elsewhere/cupy"}
    chosen = point_start_caches(environ)
    assert chosen == {name: str(tmp_path / "cache" / sub) for name, sub in START_CACHES.items()
                      if name != "CUPY_CACHE_DIR"}  # fmt: skip
    assert environ["CUPY_CACHE_DIR"] == "/elsewhere/cupy", "a variable already set was changed"
    assert environ[BUILD_CACHE_VARIABLE] == str(tmp_path / "cache" / BUILDS_DIR)
    monkeypatch.delenv(BUILD_CACHE_VARIABLE, raising=False)
    assert build_cache_dir() == tmp_path / "cache" / BUILDS_DIR
    monkeypatch.setenv(BUILD_CACHE_VARIABLE, str(tmp_path / "volume"))
    assert build_cache_dir() == tmp_path / "volume"


def test_a_start_that_does_not_know_its_model_yet_asks_for_any_model(tmp_path) -> None:
    """Before its model is loaded a start asks whether any entry fits all but the model
    (tuning_pool.start_before_the_model): then it waits for the model instead of timing."""
    cache = BuildCache(tmp_path)
    unknown = dataclasses.replace(KEY, model_id="")
    assert not cache.holds_any(unknown, ignoring=("model_id",)), "an empty cache holds nothing"
    cache.store(dataclasses.replace(KEY, model_id="0123abcd"), ENTRIES)  # another model's
    assert cache.holds_any(unknown, ignoring=("model_id",))
    assert not cache.holds_any(unknown), "the model is part of the key unless ignored"
    assert not cache.holds_any(dataclasses.replace(unknown, driver="590.1"), ignoring=("model_id",))
    (tmp_path / "broken.json").write_text("{not json")  # a corrupt entry says nothing
    assert cache.holds_any(unknown, ignoring=("model_id",))


@pytest.mark.slow  # two CPU engines built and self-checked
def test_a_cached_build_failing_the_self_check_is_dropped_and_built_afresh_once(
    monkeypatch, folded_model, caplog
) -> None:
    """serve's engine start (serving/server/serve.py `_build_engine`): an engine built from
    cached choices that fails the parity self-check has its cache entry removed and is built
    again, without the cache, then checked; the new build's choices are kept. Here the cached
    build is a CPU engine whose rows are all zeros (what a wrong cached plan could give)."""
    import types

    import numpy as np

    from speakerd.engine.factory import create_engine
    from speakerd.serving.server import serve
    from speakerd.serving.server.phases import Phases

    events: list[str] = []

    class CachedAndWrong:
        """A CPU engine built from 'cached choices' whose embeddings are wrong."""

        def __init__(self, inner) -> None:
            self.inner, self.built_from_cache = inner, True

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def run_batch(self, fbank, masks):
            run = self.inner.run_batch(fbank, masks)
            return dataclasses.replace(run, embeddings=np.zeros_like(run.embeddings))

        def embed(self, fbank, masks):
            result = self.inner.embed(fbank, masks)
            return dataclasses.replace(result, embeddings=np.zeros_like(result.embeddings))

        def forget_build(self) -> None:
            events.append("forget cached")

        def close(self) -> None:
            events.append("close cached")

    class Afresh:
        def __init__(self, inner) -> None:
            self.inner, self.built_from_cache = inner, False

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def keep_build(self) -> None:
            events.append("keep afresh")

    builds = iter([CachedAndWrong, Afresh])

    def engine(settings, prepared, model, path, phases, tuning=None):
        kind = next(builds)
        events.append(f"build {kind.__name__}")
        return kind(create_engine("cpu", model, "fp32", (1,)))

    monkeypatch.setattr(serve, "_engine", engine)
    prepared = types.SimpleNamespace(model=folded_model, engine_kind="cpu")
    with caplog.at_level(logging.WARNING):
        resolved = types.SimpleNamespace(path=None)
        built = serve._build_engine(None, prepared, resolved, Phases())  # type: ignore[arg-type]
    assert isinstance(built, Afresh), built
    expected = ["build CachedAndWrong", "forget cached", "close cached", "build Afresh", "keep afresh"]
    assert events == expected, events
    assert "self-check failed on cached start-up choices" in caplog.text and "building afresh" in caplog.text
