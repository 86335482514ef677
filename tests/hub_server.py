"""A Hugging Face hub on 127.0.0.1 for the tests: the file API `hf_hub_download` speaks, and
a cache layout built by hand, as huggingface_hub leaves one behind.

The server answers `HEAD` and `GET /{org}/{name}/resolve/{revision}/{file}` as the hub does:
200 with `X-Repo-Commit`, `ETag` (the file's sha256, as for an LFS file) and
`Content-Length`; and the hub's refusals with their `X-Error-Code` header, which is what
huggingface_hub turns into its error types: 401 `GatedRepo` without the repo's token, 403
`GatedRepo` with another token, 401 for a private repo without a token and 403 with a wrong
one, 404 `RepoNotFound`, `RevisionNotFound` and `EntryNotFound`. Nothing else is
reachable from the tests; `HF_ENDPOINT` points huggingface_hub here.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def commit_of(text: str) -> str:
    """A 40-hex commit hash, derived from `text` so each repo's is fixed."""
    return hashlib.sha1(text.encode()).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    #: branch or tag -> commit; the commit itself always resolves too
    refs: dict[str, str] = field(default_factory=dict)
    #: "gated" or "private": then only `token` may read it
    access: str = "public"
    token: str = ""


class Hub:
    """The hub's file API on 127.0.0.1 (a free port), in a daemon thread; `close()` stops it."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.requests: list[str] = []  # "HEAD /org/name/resolve/..." for each request served
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def log_message(self, format: str, *args: object) -> None:  # quiet test output
                pass

            def _refuse(self, status: int, code: str | None) -> None:
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _answer(self, body: bool) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                parts = self.path.split("?")[0].strip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    return self._refuse(404, None)
                repo_id, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self._refuse(404, "RepoNotFound")
                if repo.access != "public":
                    sent = self.headers.get("Authorization", "")
                    if sent != f"Bearer {repo.token}":
                        status = 403 if sent else 401
                        return self._refuse(status, "GatedRepo" if repo.access == "gated" else None)
                commit = repo.commit if revision == repo.commit else repo.refs.get(revision)
                if commit is None:
                    return self._refuse(404, "RevisionNotFound")
                if filename not in repo.files:
                    return self._refuse(404, "EntryNotFound")
                data = repo.files[filename]
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def build_cache(
    cache: Path, repo_id: str, filename: str, data: bytes, commit: str, ref: str = "main"
) -> Path:
    """huggingface_hub's cache layout for one file of one repo, built by hand:
    models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>,
    refs/<ref> holding the commit}. Returns the blob's path."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    pointer = folder / "snapshots" / commit / filename
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return blob
