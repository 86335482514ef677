"""Real certificates for the TLS tests, made with the `openssl` command in a test's directory.

A CA, and leaf certificates it signs for 127.0.0.1/localhost (server) or a client name
(client); P-256 keys because they are made in milliseconds. Nothing is committed: every
run makes its own, valid for two days.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl")
KEY_ARGS = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
DAYS = "2"


def require_openssl() -> str:
    if OPENSSL is None:
        pytest.skip("the openssl command is not installed; the TLS tests make their certificates with it")
    return OPENSSL


def _run(*args: str, cwd: Path) -> None:
    done = subprocess.run([require_openssl(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"openssl {' '.join(args)} failed:\n{done.stderr}"


@dataclass(frozen=True)
class Authority:
    """A CA's certificate and key, able to sign leaf certificates."""

    cert: Path
    key: Path

    @classmethod
    def create(cls, directory: Path, name: str) -> Authority:
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = directory / f"{name}.crt", directory / f"{name}.key"
        _run("req", "-x509", *KEY_ARGS, "-keyout", str(key), "-out", str(cert), "-days", DAYS,
             "-subj", f"/CN=speakerd test {name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)  # fmt: skip
        return cls(cert, key)

    def issue(self, directory: Path, name: str, server: bool) -> tuple[Path, Path]:
        """(certificate, key) for a server on 127.0.0.1/localhost, or for a client `name`."""
        directory.mkdir(parents=True, exist_ok=True)
        cert, key, request = directory / f"{name}.crt", directory / f"{name}.key", directory / f"{name}.csr"
        subject = "/CN=localhost" if server else f"/CN={name}"
        _run("req", *KEY_ARGS, "-keyout", str(key), "-out", str(request), "-subj", subject, cwd=directory)
        extensions = directory / f"{name}.ext"
        usage = "serverAuth" if server else "clientAuth"
        names = "subjectAltName=DNS:localhost,IP:127.0.0.1\n" if server else ""
        extensions.write_text(f"{names}extendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n")
        _run("x509", "-req", "-in", str(request), "-CA", str(self.cert), "-CAkey", str(self.key),
             "-CAcreateserial", "-out", str(cert), "-days", DAYS, "-extfile", str(extensions),
             cwd=directory)  # fmt: skip
        return cert, key
