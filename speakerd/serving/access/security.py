"""TLS and mutual TLS for the gRPC port, with the certificate files reloaded when they change.

Why reload: certificates are short-lived where they are rotated automatically (cert-manager
renews a Kubernetes Secret, the kubelet swaps the mounted files); restarting every replica
for each renewal would drain all of them. grpc's dynamic server credentials ask a fetcher
for the configuration on every new connection: the fetcher here returns a new one only
when a file's size or modification time changed, and keeps the last good one when a
rotation is half written (a key that does not match its certificate is refused by the TLS
library at the next handshake, so the files are read as a set and checked for PEM blocks).
Connections already open keep the certificate they were made with.

The metrics port is not covered: it stays plain HTTP for the cluster's Prometheus.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
PEM_PRIVATE_KEY = b"PRIVATE KEY-----"


class TlsFileError(ValueError):
    """A TLS file that is missing, unreadable or holds no PEM block of the kind expected."""


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate chain and key, and the CA clients must chain to (mTLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def paths(self) -> tuple[Path, ...]:
        return (self.cert, self.key) if self.client_ca is None else (self.cert, self.key, self.client_ca)

    def signature(self) -> tuple[tuple[int, int], ...]:
        """(mtime_ns, size) of each file: a rotation changes at least one of them."""
        stats = [os.stat(path) for path in self.paths()]
        return tuple((stat.st_mtime_ns, stat.st_size) for stat in stats)

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, key, client CA or None), each checked to hold its PEM block."""
        cert = _read_pem(self.cert, PEM_CERTIFICATE, "--tls-cert", "a PEM certificate")
        key = _read_pem(self.key, PEM_PRIVATE_KEY, "--tls-key", "a PEM private key")
        ca = None
        if self.client_ca is not None:
            ca = _read_pem(self.client_ca, PEM_CERTIFICATE, "--tls-client-ca", "PEM CA certificates")
        return cert, key, ca


def _read_pem(path: Path, marker: bytes, flag: str, expected: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise TlsFileError(f"{flag} {path}: cannot read it ({error.strerror})") from error
    if marker not in data:
        raise TlsFileError(f"{flag} {path}: expected {expected}, found none")
    return data


def _configuration(cert: bytes, key: bytes, ca: bytes | None) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


class ReloadingCertificates:
    """The certificate configuration fetcher of `grpc.dynamic_ssl_server_credentials`.

    grpc calls it from its own threads on each new connection; it answers None (keep the
    current configuration) unless the files changed since the last configuration it gave.
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._signature = files.signature()
        self.initial = _configuration(*files.read())
        self.reloads = 0

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            try:
                signature = self.files.signature()
                if signature == self._signature:
                    return None
                configuration = _configuration(*self.files.read())
            except (OSError, TlsFileError) as error:
                # mid-rotation (one file replaced, the other not yet) or a broken file: the
                # configuration in use stays until the files read as a whole again
                log.warning("TLS files not reloaded, keeping the current certificate: %s", error)
                return None
            self._signature = signature
            self.reloads += 1
            log.info("TLS certificate reloaded from %s (reload %d)", self.files.cert, self.reloads)
            return configuration


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """TLS credentials that reload `files` on change; client certificates required when
    `files.client_ca` is set. TlsFileError when a file is unusable at start."""
    fetcher = ReloadingCertificates(files)
    return grpc.dynamic_ssl_server_credentials(
        fetcher.initial, fetcher, require_client_authentication=files.client_ca is not None
    )


def add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Listen on `address` (over TLS with `credentials`); the port bound. RuntimeError saying
    why when it cannot (gRPC's "Failed to bind to address ...", or none bound)."""
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise RuntimeError("the port was not bound")
    return port
