"""fbank on the GPU for EmbedRecording (engine/gpu/recording.py) and for EmbedChunks'
waveform input (engine/gpu/waveform.py), against the host's.

What a newcomer should read here: a recording pushed in uneven pieces gives the same
windows on the device as the host's shared frames (within float32's own error); windows
that stay on the device and are written into the engine's staging slot give the very bits
of the same values staged from the host, mixed with host pieces in one batch; and a whole
recording embedded through the decoder with the GPU source matches the host source within
each math's bound; waveform chunks get the same treatment. Each test prints its table.
"""

from __future__ import annotations

import numpy as np
import pytest

from speakerd.model.architecture import MASK_FRAMES, MAX_SPEAKERS
from speakerd.model.audio import speaker_masks, synthetic_recording
from speakerd.model.fbank import STEP_SAMPLES, chunk_starts
from speakerd.model.numerics import BOUNDS, Math, compare
from speakerd.model.recording import Encoding, RecordingDecoder, SharedFrames
from tests.test_gpu_engine import GPU_DETAIL, GPU_USABLE

needs_gpu = pytest.mark.skipif(not GPU_USABLE, reason=f"no usable GPU for the CuPy engine: {GPU_DETAIL}")
#: A 23.5 s three-speaker recording: 14 full windows and a padded last one (7.5 s real).
SECONDS = 23.5
SEED = 7
#: Uneven push sizes (samples), so pieces split frames and windows anywhere.
PIECES = (1, 399, 16_001, 50_000, 123_457)
#: Device and host fbank differ by float32 rounding of the same arithmetic: the host's
#: float32 NumPy pipeline is within ~4e-4 of float64 on real-looking audio, the device's
#: float64 kernel within ~2e-6.
FBANK_MAX_ABS = 4e-4


def _pushed(source, samples: np.ndarray):
    at, index = 0, 0
    while at < samples.shape[0]:
        size = PIECES[index % len(PIECES)]
        source.push(samples[at : at + size])
        at, index = at + size, index + 1
    return source.finish()


@pytest.fixture(scope="module")
def recording():
    rec = synthetic_recording(SECONDS, SEED)
    masks = speaker_masks(rec, chunk_starts(rec.samples.shape[0]), MASK_FRAMES)
    return rec, masks


@pytest.fixture(scope="module")
def engines(folded_model):
    from speakerd.engine.gpu.engine import GpuEngine

    built = {math: GpuEngine(folded_model, math, (32,)) for math in (Math.FP32, Math.FP16)}
    yield built
    for engine in built.values():
        engine.close()


@pytest.mark.gpu
@needs_gpu
def test_device_windows_equal_the_host_shared_frames(recording, capsys) -> None:
    from speakerd.engine.gpu.recording import GpuRecordingFrames

    rec, _ = recording
    host, device = SharedFrames(STEP_SAMPLES), GpuRecordingFrames(STEP_SAMPLES)
    count = _pushed(host, rec.samples)
    assert _pushed(device, rec.samples) == count == chunk_starts(rec.samples.shape[0]).shape[0], count
    expected = host.windows(0, count)
    got = np.asarray(device.windows(0, count))
    sliced = np.asarray(device.windows(0, count)[count - 3 : count])  # the padded window among them
    diff = np.abs(got - expected)
    with capsys.disabled():
        print(f"\nGPU recording fbank, {count} windows: max abs {diff.max():.3e}, mean abs {diff.mean():.3e} "
              f"(bound {FBANK_MAX_ABS})", flush=True)  # fmt: skip
    assert diff.max() < FBANK_MAX_ABS, f"max abs {diff.max():.3e} >= {FBANK_MAX_ABS}"
    assert np.array_equal(sliced, got[count - 3 :]), "a slice of the rows is not the same rows"


@pytest.mark.parametrize("math", [Math.FP32, Math.FP16], ids=str)
@pytest.mark.gpu
@needs_gpu
def test_device_rows_stage_the_bits_of_the_same_host_rows(engines, recording, math, capsys) -> None:
    """A batch of device rows, a host piece and more device rows (the padded window among
    them) gives the bits of the same batch staged entirely from the host."""
    rec, masks = recording
    engine = engines[math]
    source = engine.fbank_source(STEP_SAMPLES)
    count = _pushed(source, rec.samples)
    rows = source.windows(0, count)
    other = np.asarray(rows[3:4]) + np.float32(0.25)  # a host piece from "another request"
    pieces = [rows[:5], other, rows[5:count]]
    host_pieces = [np.asarray(rows[:5]), other, np.asarray(rows[5:count])]
    mask_pieces = [masks[:5], masks[3:4], masks[5:count]]
    device_run = engine.run_batch(pieces, mask_pieces)
    host_run = engine.run_batch(host_pieces, mask_pieces)
    differ = int(np.count_nonzero(device_run.embeddings != host_run.embeddings))
    with capsys.disabled():
        print(
            f"\n{math} b32 device rows vs host rows ({count + 1} chunks): {differ} values differ", flush=True
        )
    assert differ == 0, f"{differ} of {device_run.embeddings.size} values differ"


@pytest.mark.parametrize("math", [Math.FP32, Math.FP16], ids=str)
@pytest.mark.gpu
@needs_gpu
def test_a_recording_decoded_onto_the_gpu_matches_the_host_path(engines, recording, math, capsys) -> None:
    """PCM16 stereo at 16 kHz through the decoder, fbank on the device vs on the host, the
    same engine: within the math's parity bound (they differ only by fbank rounding)."""
    rec, masks = recording
    engine = engines[math]
    pcm = np.round(np.clip(rec.samples, -1, 1) * 32767).astype("<i2")
    stereo = np.stack([pcm, pcm], axis=1).tobytes()
    results = {}
    for name, source in (("gpu", engine.fbank_source(STEP_SAMPLES)), ("host", SharedFrames(STEP_SAMPLES))):
        decoder = RecordingDecoder(16_000, 2, Encoding.S16, source=source)
        for at in range(0, len(stereo), 1 << 20):
            decoder.push(stereo[at : at + (1 << 20)])
        count = decoder.finish()
        assert count == masks.shape[0], (count, masks.shape)
        results[name] = engine.embed(np.asarray(source.windows(0, count)), masks).embeddings
    parity = compare(results["gpu"], results["host"].reshape(-1, results["host"].shape[-1]))
    bound = BOUNDS[math]
    with capsys.disabled():
        print(f"\n{math} recording gpu fbank vs host fbank, {masks.shape[0]} x {MAX_SPEAKERS} rows: "
              f"min cosine {parity.min_cosine:.9f}, max abs {parity.max_abs:.3e}", flush=True)  # fmt: skip
    assert parity.min_cosine >= bound.min_cosine, f"min cosine {parity.min_cosine:.9f} < {bound.min_cosine}"


@pytest.mark.parametrize("math", [Math.FP32, Math.FP16], ids=str)
@pytest.mark.gpu
@needs_gpu
def test_waveform_chunks_get_their_fbank_on_the_gpu(engines, recording, math, capsys) -> None:
    """EmbedChunks' waveform input: rows whose fbank the GPU computes when staged give the
    bits of the same (GPU) fbank staged from the host, and NumPy's fbank within the bound."""
    from speakerd.model.fbank import chunk_recording, fbank

    rec, masks = recording
    engine = engines[math]
    waveforms = chunk_recording(rec.samples).waveforms
    rows = engine.waveform_fbank(waveforms)
    assert rows.shape == (waveforms.shape[0], 998, 80), rows.shape
    staged = engine.run_batch([rows[:7], rows[7:]], [masks[:7], masks[7:]])
    from_host = engine.run_batch([np.asarray(rows[:7]), np.asarray(rows[7:])], [masks[:7], masks[7:]])
    differ = int(np.count_nonzero(staged.embeddings != from_host.embeddings))
    numpy_fbank = fbank(waveforms)
    fbank_diff = float(np.max(np.abs(np.asarray(rows) - numpy_fbank)))
    parity = compare(staged.embeddings, engine.run_batch(numpy_fbank, masks).embeddings)
    with capsys.disabled():
        print(f"\n{math} waveform rows on the GPU: {differ} values differ from host-staged; fbank vs "
              f"NumPy max abs {fbank_diff:.3e}; min cosine {parity.min_cosine:.9f}", flush=True)  # fmt: skip
    assert differ == 0, f"{differ} of {staged.embeddings.size} values differ"
    assert fbank_diff < FBANK_MAX_ABS, f"fbank max abs {fbank_diff:.3e} >= {FBANK_MAX_ABS}"
    assert parity.min_cosine >= BOUNDS[math].min_cosine, parity


#: (rate, channels, encoding) of recordings decoded on the GPU against the host's decoder.
PCM_FORMATS = ((48_000, 2, "S16"), (44_100, 1, "F32"), (22_050, 2, "S16"), (16_000, 3, "F32"))
#: Resampled samples: the GPU sums each output in float64, the host in float32 (BLAS); both
#: round the same float32 filters, so they differ by float32 summation rounding.
RESAMPLED_MAX_ABS = 1e-5


def _pcm(rate: int, channels: int, encoding: str, seconds: float = 12.5) -> bytes:
    """Speech-level noise with a few tones, interleaved little-endian PCM."""
    rng = np.random.default_rng(rate + channels)
    t = np.arange(int(seconds * rate)) / rate
    tones = sum(0.1 * np.sin(2 * np.pi * f * t) for f in (180.0, 950.0, 3100.0))
    signal = (tones[:, None] + 0.05 * rng.standard_normal((t.shape[0], channels))).clip(-1, 1)
    if encoding == "S16":
        return np.round(signal * 32767).astype("<i2").tobytes()
    return signal.astype("<f4").tobytes()


@pytest.mark.parametrize(("rate", "channels", "encoding"), PCM_FORMATS, ids=lambda v: str(v))
@pytest.mark.gpu
@needs_gpu
def test_pcm_decoded_and_resampled_on_the_gpu_matches_the_host(rate, channels, encoding, capsys) -> None:
    """Raw PCM given to the GPU source (decode, downmix, torchaudio-default resampling on the
    device) gives the host decoder's 16 kHz samples and window fbank, in pieces of any size."""
    import cupy

    from speakerd.engine.gpu.pcm import DevicePcm
    from speakerd.engine.gpu.recording import GpuRecordingFrames
    from speakerd.model.recording import decode_pcm, downmix
    from speakerd.model.resample import resample

    data = _pcm(rate, channels, encoding)
    kind = Encoding[encoding]
    expected = resample(downmix(decode_pcm(data, kind, channels)), rate, 16_000)
    stream = cupy.cuda.Stream(non_blocking=True)
    device = DevicePcm(rate, channels, kind, stream)
    frame = kind.itemsize * channels
    for at in range(0, len(data), 77 * frame):
        device.push(data[at : at + 77 * frame])
    mono = cupy.asnumpy(device.finish(), stream=stream)
    stream.synchronize()
    assert mono.shape == expected.shape, (mono.shape, expected.shape)
    sample_diff = float(np.max(np.abs(mono - expected)))
    fbank = {}
    for name, source in (("gpu", GpuRecordingFrames(STEP_SAMPLES)), ("host", SharedFrames(STEP_SAMPLES))):
        decoder = RecordingDecoder(rate, channels, kind, source=source)
        for at in range(0, len(data), 100_003):  # pieces that split frames
            decoder.push(data[at : at + 100_003])
        fbank[name] = np.asarray(source.windows(0, decoder.finish()))
    fbank_diff = float(np.max(np.abs(fbank["gpu"] - fbank["host"])))
    with capsys.disabled():
        print(f"\n{rate} Hz x{channels} {encoding} on the GPU: 16 kHz samples max abs {sample_diff:.3e}, "
              f"{fbank['gpu'].shape[0]} windows' fbank max abs {fbank_diff:.3e}", flush=True)  # fmt: skip
    assert sample_diff <= RESAMPLED_MAX_ABS, f"samples max abs {sample_diff:.3e} > {RESAMPLED_MAX_ABS}"
    assert fbank_diff < FBANK_MAX_ABS, f"fbank max abs {fbank_diff:.3e} >= {FBANK_MAX_ABS}"


@pytest.mark.gpu
@needs_gpu
def test_bad_f32_pcm_is_refused_by_the_gpu_decoder() -> None:
    from speakerd.engine.gpu.recording import GpuRecordingFrames
    from speakerd.model.inputs import InputError

    samples = np.zeros((40_000, 2), dtype="<f4")
    samples[31_234, 1] = 1.5
    decoder = RecordingDecoder(16_000, 2, Encoding.F32, source=GpuRecordingFrames(STEP_SAMPLES))
    decoder.push(samples[:20_000].tobytes())  # a good piece first: the index counts from the start
    with pytest.raises(InputError, match=r"frame 31234 holds NaN, Inf or \|sample\| > 1") as refused:
        decoder.push(samples[20_000:].tobytes())  # refused as it arrives, before its windows are ready
    assert refused.value.field == "audio"


@pytest.mark.parametrize(("rate", "channels"), ((16_000, 1), (48_000, 2)), ids=("16k-mono", "48k-stereo"))
@pytest.mark.gpu
@needs_gpu
def test_windows_ready_during_the_upload_equal_the_finished_recording(rate, channels, capsys) -> None:
    """Windows taken as soon as `ready()` allows, while 64 s of PCM is still arriving in
    100,003-byte pieces, hold the very bits they hold once the recording has ended: each
    frame is computed once, from samples that no later piece changes."""
    from speakerd.engine.gpu.recording import GpuRecordingFrames

    data = _pcm(rate, channels, "S16", seconds=64.0)
    source = GpuRecordingFrames(STEP_SAMPLES)
    decoder = RecordingDecoder(rate, channels, Encoding.S16, source=source)
    early, taken = [], 0
    for at in range(0, len(data), 100_003):
        decoder.push(data[at : at + 100_003])
        if decoder.ready() > taken:
            early.append(np.asarray(source.windows(taken, decoder.ready())))
            taken = decoder.ready()
    windows = decoder.finish()
    final = np.asarray(source.windows(0, windows))
    early_rows = np.concatenate(early)
    differ = int(np.count_nonzero(early_rows != final[:taken]))
    with capsys.disabled():
        print(f"\n{rate} Hz x{channels}: {taken} of {windows} windows taken during the upload in "
              f"{len(early)} reads; {differ} values differ from the finished recording's",
              flush=True)  # fmt: skip
    assert taken >= windows - 2, f"only {taken} of {windows} windows were ready before the end"
    assert differ == 0, f"{differ} values differ"
