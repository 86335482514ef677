"""TLS, mutual TLS and bearer tokens, against a real server with certificates made here.

One server runs with --tls-cert/--tls-key/--tls-client-ca and --auth-tokens: a client needs
the CA, a client certificate and a token, except for health, which stays open (Kubernetes'
gRPC probes send no metadata). The certificate and token files are rewritten while it runs:
new connections get the new certificate and calls the new tokens, without a restart.
Every test runs twice: against a server that receives its calls itself, and against one
with `--receivers 2`, whose receiver processes check certificates and tokens themselves.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from speakerd.client.cli import main as client_main
from speakerd.client.client import NO_RETRY, SpeakerClient
from speakerd.model.architecture import FRAMES, MASK_FRAMES, MEL_BINS
from speakerd.serving.access.auth import TokenFile, bearer_token, parse_tokens
from speakerd.serving.access.security import ReloadingCertificates, TlsFileError, TlsFiles
from tests.serving import ServerProcess, start_server
from tests.tls_certs import Authority, require_openssl

pytestmark = pytest.mark.slow  # a CPU server per mode: seconds of 2 cores a test

TOKEN = "first-token-0123456789"
ROTATED_TOKEN = "second-token-9876543210"
#: The tests' calls are of one chunk: one plan, so each start's self-check runs one chunk.
PLANS = "1"
#: A fresh channel per client: each connects anew, so it sees the certificate in use now.
CALL_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """CA, server and client certificates; the server's live copies sit in `live/`."""
    require_openssl()
    root = tmp_path_factory.mktemp("pki")
    ca = Authority.create(root, "ca")
    server_cert, server_key = ca.issue(root, "server", server=True)
    client_cert, client_key = ca.issue(root, "client", server=False)
    other_ca = Authority.create(root / "other", "other-ca")
    other_cert, other_key = other_ca.issue(root / "other", "server", server=True)
    live = root / "live"
    live.mkdir()
    shutil.copy(server_cert, live / "tls.crt")
    shutil.copy(server_key, live / "tls.key")
    shutil.copy(ca.cert, live / "ca.crt")
    (live / "tokens").write_text(f"# speakerd tokens\n{TOKEN}\n\n")
    return {
        "ca": ca.cert, "client_cert": client_cert, "client_key": client_key,
        "other_ca": other_ca.cert, "other_cert": other_cert, "other_key": other_key,
        "server_cert": server_cert, "server_key": server_key,
        "live_cert": live / "tls.crt", "live_key": live / "tls.key", "live_ca": live / "ca.crt",
        "tokens": live / "tokens",
    }  # fmt: skip


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "2-receivers"])
def server(request, weights_path, pki):
    """The server receiving calls itself, then with two receiver processes (each its own
    TLS and token checks, reloading the same files)."""
    receivers = ["--receivers", str(request.param)] if request.param else []
    options = {
        "tls_ca": pki["ca"],
        "tls_cert": pki["client_cert"],
        "tls_key": pki["client_key"],
        "token": TOKEN,
    }
    running = start_server(weights_path, "--plans", PLANS, "--tls-cert", str(pki["live_cert"]),
                           "--tls-key", str(pki["live_key"]), "--tls-client-ca", str(pki["live_ca"]),
                           "--auth-tokens", str(pki["tokens"]), *receivers,
                           client_options=options)  # fmt: skip
    yield running
    assert running.terminate() == 0, running.log()


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code()


def _chunk() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((1, FRAMES, MEL_BINS)).astype(np.float32), np.ones(
        (1, 2, MASK_FRAMES), np.float32
    )


def test_mutual_tls_with_token_serves(server: ServerProcess) -> None:
    assert "gRPC mutual TLS, bearer tokens required" in server.log(), server.log()
    fbank, masks = _chunk()
    with server.client(timeout_s=CALL_TIMEOUT_S) as client:
        assert client.model_info().precision == "fp32"
        assert client.embed(fbank, masks).embeddings.shape == (1, 2, 256)
        streamed = list(client.embed_stream([(fbank, masks)]))
        assert len(streamed) == 1 and np.array_equal(
            streamed[0].embeddings, client.embed(fbank, masks).embeddings
        )


def test_plaintext_and_certificateless_clients_are_refused(server: ServerProcess, pki) -> None:
    with SpeakerClient(server.target, timeout_s=5, retry=NO_RETRY, token=TOKEN) as plaintext:
        assert _code(lambda: plaintext.health(timeout_s=5)) == grpc.StatusCode.UNAVAILABLE
    # TLS, but no client certificate: the handshake fails under --tls-client-ca
    with SpeakerClient(
        server.target, timeout_s=5, retry=NO_RETRY, tls_ca=pki["ca"], token=TOKEN
    ) as anonymous:
        assert _code(lambda: anonymous.health(timeout_s=5)) == grpc.StatusCode.UNAVAILABLE


def test_missing_or_wrong_token_is_unauthenticated_but_health_is_open(server: ServerProcess) -> None:
    fbank, masks = _chunk()
    for token in (None, "not-a-token", TOKEN[:-1]):
        with server.client(token=token, retry=NO_RETRY, timeout_s=CALL_TIMEOUT_S) as client:
            assert client.health() == "SERVING", token
            assert _code(client.model_info) == grpc.StatusCode.UNAUTHENTICATED, token
            assert _code(lambda c=client: c.embed(fbank, masks)) == grpc.StatusCode.UNAUTHENTICATED, token
            stream = lambda c=client: list(c.embed_stream([(fbank, masks)]))  # noqa: E731
            assert _code(stream) == grpc.StatusCode.UNAUTHENTICATED, token


def test_tokens_reload_when_the_file_changes(server: ServerProcess, pki) -> None:
    original = pki["tokens"].read_text()
    try:
        _replace(pki["tokens"], f"{ROTATED_TOKEN}\n")
        with server.client(token=ROTATED_TOKEN, retry=NO_RETRY) as rotated:
            assert rotated.model_info().engine == "cpu-onnxruntime"
        with server.client(token=TOKEN, retry=NO_RETRY) as old:
            assert _code(old.model_info) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        _replace(pki["tokens"], original)
    assert "auth tokens reloaded" in server.log(), server.log()


def test_certificate_reloads_for_new_connections(server: ServerProcess, pki) -> None:
    """Swap in a certificate from another CA: a client trusting only the first CA is refused
    on a new connection, one trusting the other CA is served; then swap back."""
    other = {"tls_ca": pki["other_ca"], "retry": NO_RETRY}
    try:
        _replace(pki["live_key"], pki["other_key"].read_text())
        _replace(pki["live_cert"], pki["other_cert"].read_text())
        with server.client(**other) as trusting_other:
            assert trusting_other.model_info().precision == "fp32"
        with server.client(retry=NO_RETRY, timeout_s=5) as trusting_first:
            assert _code(trusting_first.model_info) == grpc.StatusCode.UNAVAILABLE
    finally:
        _replace(pki["live_key"], pki["server_key"].read_text())
        _replace(pki["live_cert"], pki["server_cert"].read_text())
    with server.client(retry=NO_RETRY) as trusting_first:
        assert trusting_first.model_info().precision == "fp32"
    assert "TLS certificate reloaded" in server.log(), server.log()


def test_client_command_line_speaks_tls_and_tokens(
    server: ServerProcess, pki, tmp_path: Path, capsys
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    tls = ["--target", server.target, "--tls-ca", str(pki["ca"]), "--tls-cert", str(pki["client_cert"]),
           "--tls-key", str(pki["client_key"])]  # fmt: skip
    assert client_main(["info", *tls, "--token-file", str(token_file)]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "fp32"
    os.environ["SPEAKERD_TOKEN"] = TOKEN
    try:
        flags = ["--streams", "1", "--seconds", "1", "--warmup", "0", "--chunks", "1"]
        assert client_main(["load", *tls, *flags]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["ok"] and report["requests_ok"] >= 1 and report["errors"] == {}, report
    finally:
        del os.environ["SPEAKERD_TOKEN"]
    assert client_main(["info", *tls]) == 1  # no token anywhere: UNAUTHENTICATED, one line
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "UNAUTHENTICATED" in error and server.target in error, error


def _replace(path: Path, text: str) -> None:
    """Write `text` next to `path` and rename it over `path`, as a Secret volume update does;
    then make sure the modification time moved even on a coarse-clock filesystem."""
    before = path.stat().st_mtime_ns
    staged = path.with_suffix(".new")
    staged.write_text(text)
    os.replace(staged, path)
    if path.stat().st_mtime_ns == before:
        os.utime(path, ns=(time.time_ns(), before + 1_000_000))


# --- the pieces alone --------------------------------------------------------------------


def test_token_parsing_and_constant_time_check(tmp_path: Path) -> None:
    assert parse_tokens("# comment\n a \n\nb\n") == (b"a", b"b")
    assert bearer_token((("x-request-id", "1"), ("authorization", "Bearer  abc "))) == "abc"
    assert bearer_token((("authorization", "Basic abc"),)) is None and bearer_token(None) is None
    path = tmp_path / "tokens"
    path.write_text("alpha\nbeta\n")
    tokens = TokenFile(path)
    assert tokens.accepts("beta") and not tokens.accepts("bet") and not tokens.accepts("")
    path.unlink()  # a vanished file keeps the tokens last read
    assert tokens.accepts("alpha")


def test_certificate_fetcher_reloads_only_on_change(pki, tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki["server_cert"], cert)
    shutil.copy(pki["server_key"], key)
    fetcher = ReloadingCertificates(TlsFiles(cert, key))
    assert fetcher() is None, "unchanged files must keep the configuration"
    _replace(cert, "not a certificate\n")
    assert fetcher() is None and fetcher.reloads == 0, "a broken file must keep the configuration"
    _replace(cert, pki["other_cert"].read_text())
    _replace(key, pki["other_key"].read_text())
    assert fetcher() is not None and fetcher.reloads == 1
    assert fetcher() is None
    with pytest.raises(TlsFileError, match=r"--tls-key .*expected a PEM private key"):
        TlsFiles(cert, cert).read()
