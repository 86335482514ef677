"""speakerd's NumPy segmentation against pyannote's own PyanNet on the real segmentation-3.0 weights.

pyannote.audio 4.0.7's `Model.from_pretrained` of the segmentation-3.0 checkpoint (what its
pipelines run) is the reference; speakerd runs the same checkpoint converted without torch.
Both forward paths (`log_probs`, per window; `recording_log_probs`, the filter bank shared
over a recording) must give pyannote's FP32 log-probabilities within 1e-4 (SPEC.md section
7) and its hard multilabel output, on pyannote's bundled sample.wav, a zero-padded last
window, an all-zero window and speech-like synthetic audio.

Two caveats, measured. Digital silence: every InstanceNorm then sees constant channels and
divides their float32 rounding by sqrt(eps) (a thousandfold, three times over), so
pyannote's own float32 output on an all-zero window is 0.14 away from its float64 forward
in the log-probabilities of classes it gives e^-20 or less; there speakerd's output must
be within twice that distance of pyannote's (two float32 results, each that close to the
float64 one), its probabilities within 1e-4, its multilabel output identical. The table
prints that distance for every case. Ties: where pyannote's own two best classes are a
float32 rounding apart,
no implementation that does not repeat torch's every rounding can promise the same winner
(sample.wav's window 1, frame 548: 9.8e-6 apart in pyannote's float32 output; the float64
forward of the same model picks the other class, as speakerd does). The multilabel output
must therefore be identical on every frame except such ties: frames whose two best classes
pyannote puts within TIE_GAP (twice the parity bound) of each other. The table counts them.

The filter bank is compared with asteroid's `ParamSincFB.filters()`, the powerset mapping
and conversion with pyannote's `Powerset`, the key table with PyanNet's module tree. Skips,
saying why, without torch, pyannote.audio or the checkpoint (.ci/run installs all three).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.pyannote_checkpoints import (
    SEGMENTATION_CHECKPOINT,
    SEGMENTATION_MISSING,
    require_pyannote,
)

torch = require_pyannote()

import soundfile  # noqa: E402

from speakerd.model.audio import synthetic_recording  # noqa: E402
from speakerd.model.fbank import chunk_recording  # noqa: E402
from speakerd.model.segmentation import architecture, forward, powerset, sincnet  # noqa: E402
from speakerd.model.segmentation.weights import convert, load_model, load_state_dict  # noqa: E402
from speakerd.pyannote import models  # noqa: E402

SEGMENTATION = SEGMENTATION_CHECKPOINT
if not SEGMENTATION.is_file():
    pytest.skip(SEGMENTATION_MISSING, allow_module_level=True)

#: SPEC.md section 7: the server's FP32 log-probabilities within 1e-4 of pyannote's.
PARITY_BOUND = 1e-4
#: A frame whose two best classes pyannote puts closer than this is a tie at float32
#: resolution: two results each within PARITY_BOUND of pyannote's may rank them either way.
TIE_GAP = 2 * PARITY_BOUND
#: The filter bank equals asteroid's to float32 rounding: torch's float32 sine is within one
#: unit in the last place of the correctly rounded one taken here, and the kernels' centre
#: taps divide a difference of sines by 2 pi t / 16000, which scales such a unit up to 1e-6.
FILTER_BOUND = 2e-6
#: ...and most of the 20,080 taps are the same bits.
FILTER_SAME_BITS = 0.9


@dataclass(frozen=True)
class Case:
    name: str
    samples: np.ndarray  # the recording [N]
    starts: np.ndarray  # its windows' first samples
    #: digital silence: every InstanceNorm sees a constant channel and divides float32
    #: rounding by sqrt(eps), so pyannote's own float32 output is rounding (see module doc)
    silent: bool = False


@pytest.fixture(scope="module")
def pyannote_model():
    """pyannote's model, on one torch thread: torch's OpenMP threads spin while they wait,
    which on 2 cores shared with other work (and speakerd's own threads) made one forward of
    3 windows take 19 s instead of 0.4 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield models.segmentation_model(SEGMENTATION).eval()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint as speakerd serves it: converted without torch to safetensors."""
    path = tmp_path_factory.mktemp("segmentation") / "segmentation-3.0.safetensors"
    convert(SEGMENTATION, path)
    return path


@pytest.fixture(scope="module")
def model(converted: Path):
    return load_model(converted)


def _cases() -> list[Case]:
    sample, rate = soundfile.read(str(models.sample_path()), dtype="float32")
    assert rate == 16_000 and sample.ndim == 1, (rate, sample.shape)
    speech = synthetic_recording(12.5, seed=31)
    return [
        Case("sample.wav windows 0-2", sample[:192_000], np.array([0, 16_000, 32_000])),
        # a 13.5 s recording's last window: 152,000 samples of sample.wav, 8,000 zeros
        Case("sample.wav, padded last window", sample[:216_000], np.array([64_000])),
        Case("all-zero window", np.zeros(160_000, np.float32), np.array([0]), silent=True),
        # 3 full windows and a padded one (7.5 s of audio)
        Case("synthetic speech (12.5 s)", speech.samples, np.array([0, 16_000, 32_000, 48_000])),
    ]


def _windows(case: Case) -> np.ndarray:
    chunks = chunk_recording(case.samples)
    rows = np.searchsorted(chunks.starts, case.starts)
    assert np.array_equal(chunks.starts[rows], case.starts), f"{case.name}: not pyannote's windows"
    return chunks.waveforms[rows]


def _pyannote_multilabel(log_probs: np.ndarray) -> np.ndarray:
    from pyannote.audio.utils.powerset import Powerset

    converter = Powerset(architecture.SPEAKERS, architecture.MAX_SET_SIZE)
    return converter.to_multilabel(torch.from_numpy(log_probs), soft=False).numpy()


@pytest.mark.slow
def test_log_probs_equal_pyannotes(pyannote_model, model) -> None:
    exact_model = copy.deepcopy(pyannote_model).double()
    rows = []
    for case in _cases():
        windows = _windows(case)
        with torch.inference_mode():
            reference = pyannote_model(torch.from_numpy(windows[:, None])).numpy()
            exact = exact_model(torch.from_numpy(windows[:, None]).double()).numpy()
        own_rounding = float(np.abs(reference - exact).max())  # pyannote's float32 vs its float64
        expected = _pyannote_multilabel(reference)
        best_two = np.sort(reference, axis=-1)[..., -2:]
        ties = (best_two[..., 1] - best_two[..., 0]) < TIE_GAP
        for math, ours in (
            ("per window", forward.log_probs(model, windows)),
            ("recording", forward.recording_log_probs(model, case.samples, case.starts)),
        ):
            assert ours.shape == reference.shape == (len(windows), 589, 7) and ours.dtype == np.float32
            same = np.all(powerset.to_multilabel(ours) == expected, axis=-1)
            worst = float(np.abs(ours - reference).max())
            probabilities = float(np.abs(np.exp(ours) - np.exp(reference)).max())
            rows.append(
                (case, math, worst, own_rounding, probabilities, int(same.sum()), same.size, int(ties.sum()),
                 int((~same & ties).sum()), int((~same & ~ties).sum()))
            )  # fmt: skip
    print(f"\n{'case':<32}{'math':<12}{'win':>4}{'max abs':>10}{'pyannote fp32-fp64':>20}"
          f"{'multilabel same':>17}{'ties':>6}{'differ at ties':>16}{'elsewhere':>11}")  # fmt: skip
    for case, math, worst, own, _, same, frames, ties, at_ties, elsewhere in rows:
        print(f"{case.name:<32}{math:<12}{len(case.starts):>4}{worst:>10.2e}{own:>20.2e}{f'{same}/{frames}':>17}"
              f"{ties:>6}{at_ties:>16}{elsewhere:>11}")  # fmt: skip
    for case, math, worst, own, probabilities, *_, elsewhere in rows:
        # two float32 results each within `own` of the float64 one are within 2 own of each other
        bound = max(PARITY_BOUND, 2 * own) if case.silent else PARITY_BOUND
        assert worst <= bound, f"{case.name}, {math}: max abs {worst:.3g} > {bound:.3g}"
        assert probabilities <= PARITY_BOUND, f"{case.name}, {math}: probabilities {probabilities:.3g} apart"
        assert elsewhere == 0, (
            f"{case.name}, {math}: multilabel differs on {elsewhere} frames that are no tie"
        )


def test_filter_bank_is_asteroids(pyannote_model, converted: Path, model) -> None:
    expected = pyannote_model.sincnet.conv1d[0].filterbank.filters().detach().numpy()
    ours = sincnet.filters(load_state_dict(converted))
    assert ours.shape == expected.shape == (80, 1, 251) and ours.dtype == np.float32
    worst, same = float(np.abs(ours - expected).max()), float(np.mean(ours == expected))
    print(f"\nfilter bank vs asteroid's: max abs {worst:.2e}, {same:.1%} of the taps the same bits")
    assert worst <= FILTER_BOUND and same >= FILTER_SAME_BITS, (worst, same)
    np.testing.assert_array_equal(model.filters, np.ascontiguousarray(ours[:, 0, :].T))


def test_powerset_is_pyannotes() -> None:
    from pyannote.audio.utils.powerset import Powerset

    reference = Powerset(architecture.SPEAKERS, architecture.MAX_SET_SIZE)
    assert [set(chosen) for chosen in powerset.powerset_classes()] == reference.powerset_classes
    np.testing.assert_array_equal(powerset.MAPPING, reference.mapping.numpy())
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((4, 589, 7)).astype(np.float32)
    scores[0, :10, 2] = scores[0, :10, 5] = 9.0  # ties: the first of the best wins, as in torch
    expected = reference.to_multilabel(torch.from_numpy(scores), soft=False).numpy()
    ours = powerset.to_multilabel(scores)
    assert ours.dtype == expected.dtype == np.float32
    np.testing.assert_array_equal(ours, expected)


def test_architecture_is_pyannets(pyannote_model) -> None:
    shapes = {key: tuple(value.shape) for key, value in pyannote_model.state_dict().items()}
    assert list(shapes) == list(architecture.state_dict_shapes())
    assert shapes == architecture.state_dict_shapes()
    field = pyannote_model.receptive_field
    assert (field.start, field.duration, field.step) == (
        architecture.FRAME_START_S, architecture.FRAME_DURATION_S, architecture.FRAME_STEP_S
    )  # fmt: skip
    assert pyannote_model.num_frames(160_000) == architecture.num_frames(160_000) == 589
    assert (
        pyannote_model.sincnet.wav_norm1d.eps == pyannote_model.sincnet.norm1d[0].eps == architecture.NORM_EPS
    )
