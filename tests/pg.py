"""A throwaway PostgreSQL cluster for the voiceprint tests: initdb into a temporary
directory, pg_ctl start on a free loopback port, trust authentication, stopped at the end.

The binaries are looked up on PATH, then in Debian's /usr/lib/postgresql/<version>/bin
(where `apt-get install postgresql` puts them; .ci/run installs it). PostgreSQL refuses to
run as root: as root the cluster belongs to the `postgres` user Debian's package creates,
and its commands run through runuser. Tests skip, saying why, only when no binaries exist.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

#: pg_ctl's own wait for the server to accept connections (start) or exit (stop).
PG_CTL_WAIT_S = 60
#: Starts tried, each on a newly picked free port: between picking a port and PostgreSQL
#: binding it, a test running beside this one (pytest-xdist) may take it.
START_ATTEMPTS = 3


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Cluster:
    directory: Path
    port: int
    runner: list[str]  # prefix that runs a command as the cluster's owner
    pg_ctl: str

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _pg_ctl(self, *args: str) -> None:
        command = [
            *self.runner,
            self.pg_ctl,
            "-D",
            str(self.directory / "data"),
            "-w",
            "-t",
            str(PG_CTL_WAIT_S),
            *args,
        ]
        subprocess.run(command, check=True, capture_output=True, text=True)

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.directory}"
        self._pg_ctl("-o", options, "-l", str(self.directory / "log"), "start")

    def stop(self) -> None:
        self._pg_ctl("-m", "fast", "stop")

    def remove(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


def start_cluster() -> Cluster:
    """A started cluster in a new directory under the system's temporary directory (which
    the postgres user can reach, unlike pytest's private ones); skip when PostgreSQL is not
    installed. `remove` stops it and deletes the directory."""
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip(
            "PostgreSQL binaries (initdb, pg_ctl) not found: apt-get install postgresql (.ci/run does)"
        )
    directory = Path(tempfile.mkdtemp(prefix="speakerd-pg-"))
    runner: list[str] = []
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no postgres user for PostgreSQL to run as")
        runner = ["runuser", "-u", "postgres", "--"]
        os.chown(directory, owner.pw_uid, owner.pw_gid)
    command = [*runner, initdb, "-D", str(directory / "data"), "-U", "postgres", "--auth=trust", "-E", "UTF8"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    attempts = START_ATTEMPTS
    while True:
        cluster = Cluster(directory, _free_port(), runner, pg_ctl)
        try:
            cluster.start()
            return cluster
        except subprocess.CalledProcessError:  # its log names the cause: kept for the last one
            attempts -= 1
            if attempts == 0:
                raise
