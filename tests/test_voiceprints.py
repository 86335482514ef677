"""The Voiceprints service of a real server process (docs/voiceprints.md), the same suite on
its SQLite store and on a PostgreSQL one (a throwaway cluster, tests/pg.py), with bearer
tokens so that each token is its own tenant; then SQLite's restart and SIGKILL.

The test model is the synthetic one: random weights, which place every voice near every
other (cosines of different synthetic speakers are ~0.9). The tests therefore identify a
speaker by the very audio they enrolled (cosine 1 to its own voiceprint, by construction of
the math) and check the service's plumbing and policies, not the model's accuracy.
"""

from __future__ import annotations

import functools
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from speakerd.client.client import RetryPolicy
from speakerd.client.voiceprints import VoiceprintClient
from speakerd.model.audio import synthetic_recording
from speakerd.v1 import speakerd_pb2 as pb
from tests.pg import Cluster, start_cluster
from tests.serving import ServerProcess, scrape, start_server, wait_until

pytestmark = pytest.mark.slow

TOKENS = ("token-of-tenant-a", "token-of-tenant-b")
#: 12 s of one synthetic speaker, embedded in two windows (a step of 5 s): cheap on the CPU engine.
SECONDS, STEP_S = 12.0, 5.0
#: The same audio scored against its own voiceprint: cosine 1 up to float32 rounding.
SAME_AUDIO_COSINE = 0.9999
#: Tests run on one store only: the command line's and pyannote's naming run the same client
#: and server code on both stores, and their store calls (put, list, delete, a search of the
#: index) are those test_list_and_delete and test_identify_takes_embeddings_and_a_threshold
#: run on PostgreSQL too.
SQLITE_ONLY = pytest.mark.parametrize("server", ["sqlite"], indirect=True)


@functools.cache
def voice(seed: int) -> np.ndarray:
    """SECONDS of speaker `seed`, made once and shared by every test (so read-only)."""
    samples = synthetic_recording(seconds=SECONDS, seed=seed, speakers=1).samples
    samples.flags.writeable = False
    return samples


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    running = start_cluster()
    yield running
    running.remove()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest, weights_path: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("voiceprints")
    tokens = directory / "tokens"
    tokens.write_text("\n".join(TOKENS) + "\n")
    store = "sqlite" if request.param == "sqlite" else request.getfixturevalue("cluster").url
    running = start_server(
        weights_path, "--data-dir", str(directory / "data"), "--voiceprints", store, "--auth-tokens",
        str(tokens), client_options={"token": TOKENS[0]},
    )  # fmt: skip
    running.backend = request.param  # type: ignore[attr-defined]
    yield running
    assert running.terminate() == 0, running.log()


def client(server: ServerProcess, token: str = TOKENS[0], **options: object) -> VoiceprintClient:
    return VoiceprintClient(server.target, timeout_s=300, token=token, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def enrolled(server: ServerProcess) -> dict[str, pb.Voiceprint]:
    """Tenant A's speakers s11 and s12, each from its whole recording."""
    with client(server) as a:
        return {name: a.enroll(name, voice(seed), 16000, step_s=STEP_S).voiceprint
                for name, seed in (("s11", 11), ("s12", 12))}  # fmt: skip


def violation(error: grpc.RpcError) -> list[tuple[str, str]]:
    """(field, description) of the error's BadRequest detail."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    found = []
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            found += [(v.field, v.description) for v in bad.field_violations]
    return found


def refused(call, code: grpc.StatusCode, field: str) -> str:
    """Run `call`; assert it fails with `code` and a BadRequest detail naming `field`; its message."""
    with pytest.raises(grpc.RpcError) as failure:
        call()
    error = failure.value
    assert error.code() == code, error.details()
    assert [f for f, _ in violation(error)] == [field], error.details()
    assert error.details().startswith(f"{field}: ")
    return error.details()


# --- the calls -----------------------------------------------------------------------------


def test_an_enrollment_says_what_it_holds(enrolled: dict[str, pb.Voiceprint], server: ServerProcess) -> None:
    s11 = enrolled["s11"]
    assert s11.speaker_id == "s11" and len(s11.voiceprint_id) == 32
    assert s11.speech_s == pytest.approx(SECONDS, abs=0.02)  # the whole audio, each moment once
    assert s11.windows == 2 and 0 < s11.quality <= 1
    with client(server) as a:
        assert s11.model_id == a.model_info().model_id


def test_a_speaker_is_identified_by_their_own_recording(enrolled, server: ServerProcess) -> None:
    with client(server) as a:
        found = a.identify(samples=voice(11), sample_rate=16000, step_s=STEP_S, top_k=2)
    (row,) = found.rows
    assert not row.unknown and row.speaker_id == "s11"
    assert [m.speaker_id for m in row.matches] == ["s11", "s12"]
    assert row.matches[0].score >= SAME_AUDIO_COSINE and row.matches[0].score >= row.matches[1].score
    assert found.threshold == 0.5 and found.other_model_voiceprints == 0
    assert len(found.request_id) == 16  # the client's x-request-id, echoed


def test_identify_takes_embeddings_and_a_threshold(enrolled, server: ServerProcess) -> None:
    rows = np.zeros((2, 256), np.float32)
    rows[0] = 1.0  # a direction, not a voice
    rows[1] = -1.0
    with client(server) as a:
        strict = a.identify(embeddings=rows, threshold=1.0, top_k=5)
        lenient = a.identify(embeddings=rows, threshold=-1.0)
    assert [r.unknown for r in strict.rows] == [True, True] and strict.threshold == 1.0
    assert [len(r.matches) for r in strict.rows] == [2, 2]  # top 5 of 2 voiceprints
    assert [r.unknown for r in lenient.rows] == [False, False]


def test_verify_scores_a_recording_against_one_voiceprint(enrolled, server: ServerProcess) -> None:
    with client(server) as a:
        same = a.verify(enrolled["s11"].voiceprint_id, samples=voice(11), sample_rate=16000, step_s=STEP_S)
        strict = a.verify(enrolled["s12"].voiceprint_id, samples=voice(11), sample_rate=16000, step_s=STEP_S,
                          threshold=1.0)  # fmt: skip
    assert same.accepted and same.score >= SAME_AUDIO_COSINE and same.speaker_id == "s11"
    assert same.speech_s == pytest.approx(SECONDS, abs=0.02)
    assert not strict.accepted and strict.score < 1.0 and strict.threshold == 1.0


def test_list_and_delete(enrolled, server: ServerProcess) -> None:
    with client(server) as a:
        temp = a.enroll("temp", voice(13), 16000, step_s=STEP_S).voiceprint
        assert [v.speaker_id for v in a.list_voiceprints()] == ["s11", "s12", "temp"]
        assert a.delete_voiceprint(temp.voiceprint_id).speaker_id == "temp"
        assert [v.speaker_id for v in a.list_voiceprints()] == ["s11", "s12"]
        found = a.identify(samples=voice(13), sample_rate=16000, step_s=STEP_S, top_k=10)
        assert "temp" not in [m.speaker_id for m in found.rows[0].matches]  # gone from the index too
        refused(lambda: a.delete_voiceprint(temp.voiceprint_id), grpc.StatusCode.NOT_FOUND, "voiceprint_id")


# --- tenants -------------------------------------------------------------------------------


def test_another_tenants_voiceprint_is_indistinguishable_from_an_unknown_one(enrolled, server) -> None:
    theirs = enrolled["s11"].voiceprint_id
    unknown = "0" * 32
    with client(server, TOKENS[1]) as b:
        assert b.list_voiceprints() == []
        assert b.identify(embeddings=np.ones((1, 256), np.float32)).rows[0].matches == []
        for call in (lambda vid: b.delete_voiceprint(vid), lambda vid: b.verify(vid, embedding=np.ones(256))):
            message_theirs = refused(lambda c=call: c(theirs), grpc.StatusCode.NOT_FOUND, "voiceprint_id")
            message_unknown = refused(lambda c=call: c(unknown), grpc.StatusCode.NOT_FOUND, "voiceprint_id")
            assert message_theirs.replace(theirs, unknown) == message_unknown
        assert b.enroll("s11", voice(11), 16000, step_s=STEP_S).replaced_voiceprint_id == ""  # own namespace
    with client(server) as a:
        assert theirs in [v.voiceprint_id for v in a.list_voiceprints()]  # A's is untouched


# --- bad input -----------------------------------------------------------------------------


def test_bad_input_names_the_field(enrolled, server: ServerProcess) -> None:
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    one = np.ones((1, 256), np.float32)
    with client(server) as a:
        for threshold in (1.5, -1.01, float("nan")):
            refused(lambda t=threshold: a.identify(embeddings=one, threshold=t), invalid, "threshold")
        refused(lambda: a.identify(embeddings=one, top_k=101), invalid, "top_k")
        refused(lambda: a.identify(embeddings=np.ones((1, 128), np.float32)), invalid, "speech.embeddings")
        refused(lambda: a.identify(embeddings=np.zeros((1, 256), np.float32)), invalid, "speech.embeddings")
        silent = np.zeros(int(SECONDS * 16000), np.int16)
        message = refused(lambda: a.enroll("quiet", silent, 16000, step_s=STEP_S), invalid, "audio")
        assert "silent" in message
        short = refused(lambda: a.enroll("short", voice(14), 16000, segments=[(0.0, 2.0)], step_s=STEP_S),
                        invalid, "speech")  # fmt: skip
        # 2 s of segments, as whole 17 ms mask frames
        assert re.fullmatch(
            r"speech: 2\.0\d s of speech under the masks, expected at least 3 s to enroll", short
        )
        refused(lambda: a.enroll("", voice(14), 16000), invalid, "speaker_id")
        refused(lambda: a.enroll("x", voice(14), 16000, segments=[(3.0, 1.0)]), invalid, "speech.segments[0]")
        refused(
            lambda: a.verify("0" * 32, embedding=np.ones(256)), grpc.StatusCode.NOT_FOUND, "voiceprint_id"
        )
        assert [v.speaker_id for v in a.list_voiceprints()] == ["s11", "s12"]  # none of them wrote anything


def test_empty_audio_is_refused(server: ServerProcess) -> None:
    with client(server) as a:
        stub = a._voiceprints
        header = pb.EnrollHeader(speaker_id="nobody", speech=pb.SpeechHeader(recording=pb.RecordingHeader(
            sample_rate=16000, channels=1, encoding=pb.AUDIO_ENCODING_PCM_S16LE)))  # fmt: skip
        message = refused(lambda: stub.Enroll(iter([pb.EnrollRequest(header=header)]), timeout=60,
                                              metadata=a._metadata()),
                          grpc.StatusCode.INVALID_ARGUMENT, "audio")  # fmt: skip
        assert "no audio" in message


def test_a_duplicate_speaker_is_refused_unless_replaced(enrolled, server: ServerProcess) -> None:
    with client(server) as a:
        message = refused(lambda: a.enroll("s12", voice(12), 16000, step_s=STEP_S),
                          grpc.StatusCode.ALREADY_EXISTS, "speaker_id")  # fmt: skip
        assert enrolled["s12"].voiceprint_id in message and "replace" in message
        again = a.enroll("s12", voice(12), 16000, step_s=STEP_S, replace=True)
        assert again.replaced_voiceprint_id == enrolled["s12"].voiceprint_id
        enrolled["s12"] = again.voiceprint
        ids = [v.voiceprint_id for v in a.list_voiceprints()]
        assert again.voiceprint.voiceprint_id in ids and again.replaced_voiceprint_id not in ids


# --- PostgreSQL: other replicas, other weights, a database that is down ----------------------


def test_a_voiceprint_of_other_weights_is_not_compared(enrolled, server: ServerProcess) -> None:
    if server.backend != "postgresql":  # type: ignore[attr-defined]
        pytest.skip("another server's writes reach this one through PostgreSQL only")
    from speakerd.serving.voiceprints.postgres_store import PostgresStore
    from speakerd.serving.voiceprints.records import VoiceprintRecord
    from speakerd.serving.voiceprints.tenants import tenant_of

    tenant = tenant_of((("authorization", f"Bearer {TOKENS[0]}"),), authenticated=True)
    other = VoiceprintRecord.new(tenant, "elsewhere", "f" * 64, np.ones(256, np.float32) / 16, 20.0, 0.9, 20)
    replica = PostgresStore(_url(server))
    replica.put(other, replace=False)  # a replica serving other weights enrolls
    try:
        with client(server) as a:
            deadline = time.monotonic() + 5
            while a.identify(embeddings=np.ones((1, 256), np.float32)).other_model_voiceprints != 1:
                assert time.monotonic() < deadline, "the other replica's enrollment never arrived"
                time.sleep(0.05)
            message = refused(lambda: a.verify(other.voiceprint_id, embedding=np.ones(256)),
                              grpc.StatusCode.FAILED_PRECONDITION, "voiceprint_id")  # fmt: skip
            assert "ffffffffffff" in message
    finally:
        replica.delete(tenant, other.voiceprint_id)
        replica.close()


def _url(server: ServerProcess) -> str:
    command = server.process.args
    return str(command[command.index("--voiceprints") + 1])  # type: ignore[union-attr]


def test_a_database_that_is_down_is_unavailable_then_retried(
    enrolled, server: ServerProcess, request
) -> None:
    if server.backend != "postgresql":  # type: ignore[attr-defined]
        pytest.skip("the SQLite file cannot be down")
    cluster: Cluster = request.getfixturevalue("cluster")
    cluster.stop()
    try:
        with client(server, retry=RetryPolicy(attempts=1)) as a:
            with pytest.raises(grpc.RpcError) as down:
                a.list_voiceprints()
            assert down.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "nothing was written" in down.value.details()
        restart = threading.Timer(2.0, cluster.start)
        restart.start()
        patient = RetryPolicy(attempts=40, initial_backoff_s=0.2, max_backoff_s=1.0)
        with client(server, retry=patient) as a:  # the client's retries outlast the outage
            late = a.enroll("late", voice(15), 16000, step_s=STEP_S).voiceprint
        restart.join()
    finally:
        if cluster.port and not _accepting(cluster):
            cluster.start()
    with client(server) as a:
        assert [v.speaker_id for v in a.list_voiceprints()].count("late") == 1
        a.delete_voiceprint(late.voiceprint_id)


def _accepting(cluster: Cluster) -> bool:
    import psycopg

    try:
        psycopg.connect(cluster.url, connect_timeout=2).close()
        return True
    except psycopg.OperationalError:
        return False


# --- SQLite: restart and SIGKILL -------------------------------------------------------------

#: Chunks waiting for the engine: above 0 once a call's windows are being embedded.
QUEUED_CHUNKS = "speakerd_queue_depth_chunks{}"


def test_sqlite_voiceprints_survive_a_restart_and_a_sigkill_mid_enrollment(
    weights_path: Path, tmp_path
) -> None:
    data = tmp_path / "data"
    first = start_server(weights_path, "--data-dir", str(data))
    with VoiceprintClient(first.target, timeout_s=300) as a:
        kept = a.enroll("kept", voice(21), 16000, step_s=STEP_S).voiceprint
    # one server per SQLite store: a second on the same directory would never hear of the
    # first one's enrollments (its index is its own), so it refuses to start, naming the flag
    second_server = subprocess.run(
        [sys.executable, "-m", "speakerd", "serve", "--engine", "cpu", "--port", "0", "--metrics-port", "0",
         "--model", str(weights_path), "--data-dir", str(data)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    refusal = second_server.stderr.strip().splitlines()
    print(f"\nsecond server on {data}: exit {second_server.returncode}: {refusal[-1] if refusal else ''}")
    assert second_server.returncode == 2 and len(refusal) == 1, second_server.stderr[-2000:]
    assert f"--data-dir {data}" in refusal[0] and f"pid {first.process.pid}" in refusal[0], refusal[0]
    assert first.terminate() == 0, first.log()

    second = start_server(weights_path, "--data-dir", str(data))  # restarted on the same directory
    with VoiceprintClient(second.target, timeout_s=300) as a:
        assert [v.voiceprint_id for v in a.list_voiceprints()] == [kept.voiceprint_id]
        same = a.verify(kept.voiceprint_id, samples=voice(21), sample_rate=16000, step_s=STEP_S)
        assert same.accepted and same.score >= SAME_AUDIO_COSINE
        long = synthetic_recording(seconds=120.0, seed=22, speakers=1).samples
        outcome: list[object] = []
        enrolling = threading.Thread(
            target=lambda: outcome.append(_try(lambda: a.enroll("killed", long, 16000)))
        )
        enrolling.start()
        # killed once windows of its 111 wait for the engine (the verify's were all embedded
        # before it answered, so these are the enrollment's): embedding, far from its write
        wait_until(lambda: scrape(second)[QUEUED_CHUNKS] > 0, "the enrollment's windows queued", second,
                   timeout_s=120)  # fmt: skip
        second.process.send_signal(signal.SIGKILL)
        enrolling.join(60)
    second.wait(30)
    assert isinstance(outcome[0], grpc.RpcError)  # the call died with the server

    with sqlite3.connect(data / "voiceprints.sqlite3") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    # the SIGKILLed server's lock went with it: the kernel drops an flock with its holder
    third = start_server(weights_path, "--data-dir", str(data))
    with VoiceprintClient(third.target, timeout_s=300) as a:
        assert [v.speaker_id for v in a.list_voiceprints()] == ["kept"]  # whole, and nothing torn
    assert third.terminate() == 0, third.log()
    log = first.log() + second.log() + third.log()
    assert "kept" not in log and "killed" not in log  # speaker ids are not logged


def _try(call):  # type: ignore[no-untyped-def]
    try:
        return call()
    except grpc.RpcError as error:
        return error


# --- pyannote: a diarization's labels named from the embeddings it already has --------------


@SQLITE_ONLY
def test_a_diarizations_speakers_get_their_enrolled_names(enrolled, server: ServerProcess) -> None:
    pytest.importorskip("pyannote.audio", reason="pyannote.audio not installed (the pyannote extra)")
    from pyannote.audio.pipelines.speaker_diarization import DiarizeOutput
    from pyannote.core import Annotation, Segment

    import speakerd.pyannote
    from speakerd.model.recording import window_count
    from speakerd.model.voiceprint import pool, segment_masks

    diarization = Annotation(uri="meeting")
    for start, label in ((0, "SPEAKER_00"), (12, "SPEAKER_01"), (24, "SPEAKER_02")):
        diarization[Segment(start, start + 12)] = label
    rows = np.zeros((3, 256), np.float32)  # SPEAKER_02: a speaker pyannote has no centroid for
    with client(server) as a:
        for row, seed in ((0, 11), (1, 12)):  # the centroids a pipeline on this server computes
            samples = voice(seed)
            windows = window_count(samples.shape[0], int(STEP_S * 16000))
            masks = segment_masks(
                [(0.0, SECONDS)], windows, STEP_S
            )  # the masks Enroll made of the whole audio
            served = a.embed_recording(samples, 16000, masks, step_s=STEP_S)
            pooled = pool(served.embeddings[:, 0], served.active_frames[:, 0])
            assert pooled is not None
            rows[row] = 3.0 * pooled.vector  # pyannote's centroids are not unit length
        output = DiarizeOutput(diarization, diarization, rows)
        named = speakerd.pyannote.name_speakers(output, a, threshold=SAME_AUDIO_COSINE)
    assert named.speaker_diarization.labels() == ["SPEAKER_02", "s11", "s12"]
    assert named.exclusive_speaker_diarization.labels() == ["SPEAKER_02", "s11", "s12"]
    assert output.speaker_diarization.labels() == ["SPEAKER_00", "SPEAKER_01", "SPEAKER_02"]  # a copy


# --- the command line ----------------------------------------------------------------------


@SQLITE_ONLY
def test_the_command_line_enrolls_and_identifies_from_a_file_and_its_masks(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Quick start's flow (docs/voiceprints.md) on a two-speaker file: each speaker is a
    mask column; enrolled by column, identified by column."""
    import json

    import soundfile

    from speakerd.client.cli import main
    from speakerd.model.recording import window_count

    first, second = voice(31), voice(32)
    samples = np.concatenate([first, second])
    audio, masks_file, token = tmp_path / "two.wav", tmp_path / "two-masks.npy", tmp_path / "token"
    soundfile.write(audio, samples, 16000, subtype="FLOAT")
    step = int(STEP_S * 16000)
    windows = window_count(samples.shape[0], step)
    starts = np.arange(windows)[:, None] * STEP_S + (np.arange(589)[None, :] + 0.5) * 10 / 589
    masks = np.stack([starts < SECONDS, (starts >= SECONDS) & (starts < 2 * SECONDS)], axis=1)
    np.save(masks_file, masks.astype(np.uint8))
    token.write_text(TOKENS[1] + "\n")  # tenant B: nothing else enrolled there but its own s11
    common = ["--target", server.target, "--token-file", str(token)]
    speech = ["--audio", str(audio), "--masks", str(masks_file), "--step", str(STEP_S)]

    def run(*argv: str) -> dict:
        assert main([*argv, *common]) == 0
        return json.loads(capsys.readouterr().out)

    ids = {}
    for column, name in ((0, "first"), (1, "second")):
        ids[name] = run("enroll", "--speaker-id", name, *speech, "--column", str(column))["voiceprint"][
            "voiceprint_id"
        ]
    for column, name in ((0, "first"), (1, "second")):
        found = run(
            "identify",
            *speech,
            "--column",
            str(column),
            "--top-k",
            "2",
            "--threshold",
            str(SAME_AUDIO_COSINE),
        )
        (row,) = found["rows"]
        assert row["speaker_id"] == name and row["matches"][0]["voiceprint_id"] == ids[name]
    listed = run("voiceprints", "list")
    assert {v["speaker_id"] for v in listed["voiceprints"]} >= {"first", "second"}
    for voiceprint_id in ids.values():
        run("voiceprints", "delete", voiceprint_id)
