"""A small Hugging Face Hub on 127.0.0.1 for tests: what huggingface_hub 2.4
calls to resolve a revision, list a repo and download its files.

- `GET /api/models/{repo}[/revision/{rev}]`: id, sha, siblings (repo_info,
  model_info, resolve_revision);
- `GET /api/models/{repo}/tree/{rev}`: the files with size and oid
  (snapshot_download's listing);
- `HEAD` / `GET /{repo}/resolve/{rev}/{path}`: X-Repo-Commit, ETag,
  Content-Length, the bytes (hf_hub_download).

Errors as the Hub sends them: a status code and X-Error-Code (RepoNotFound,
RevisionNotFound, EntryNotFound, GatedRepo). Each repo is a set of commits
(path -> bytes) and refs (branch or tag -> commit); every request is
recorded in `requests`. `after_revision_lookup(repo_id, fn)` runs `fn` once,
right after the first revision lookup of that repo is answered (a branch that
moves mid-download).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit


class HubRequest(NamedTuple):
    method: str
    path: str
    authorization: str | None


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False

    def sha_of(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


# No revision part: the default branch.
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[HubRequest] = []
        self._hooks: dict[str, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def commit(self, repo_id: str, files: dict[str, bytes], ref: str = "main", *, gated: bool = False) -> str:
        """Add a commit holding exactly `files` and point `ref` at it; its sha."""
        repo = self.repos.setdefault(repo_id, FakeRepo())
        repo.gated = repo.gated or gated
        digest = hashlib.sha1(repr(sorted((p, hashlib.sha1(b).hexdigest()) for p, b in files.items())).encode())
        digest.update(f"{repo_id}:{ref}:{len(repo.commits)}".encode())
        sha = digest.hexdigest()
        repo.commits[sha] = dict(files)
        repo.refs[ref] = sha
        return sha

    def after_revision_lookup(self, repo_id: str, hook: Callable[[], None]) -> None:
        self._hooks[repo_id] = hook

    def file_requests(self, repo_id: str) -> list[tuple[str, str]]:
        """(revision, path) of each resolve request for `repo_id`."""
        found = []
        for request in self.requests:
            match = _RESOLVE.match(request.path)
            if match and match["repo"] == repo_id:
                found.append((unquote(match["rev"]), unquote(match["path"])))
        return found

    # ---- answering ----------------------------------------------------------

    def answer(self, method: str, path: str, headers: Any) -> tuple[int, dict[str, str], bytes]:
        with self._lock:
            self.requests.append(HubRequest(method, path, headers.get("Authorization")))
        if (match := _API.match(path)) is not None:
            return self._api(match["repo"], match["kind"] or "revision", unquote(match["rev"] or "main"))
        if (match := _RESOLVE.match(path)) is not None:
            return self._resolve(match["repo"], unquote(match["rev"]), unquote(match["path"]), headers)
        return 404, {"X-Error-Code": "RepoNotFound"}, b""

    def _api(self, repo_id: str, kind: str, revision: str) -> tuple[int, dict[str, str], bytes]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(404, "RepoNotFound")
        sha = repo.sha_of(revision)
        if sha is None:
            return _error(404, "RevisionNotFound")
        files = repo.commits[sha]
        if kind == "tree":
            body: Any = [
                {"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for p, b in sorted(files.items())
            ]
        else:
            body = {"id": repo_id, "sha": sha, "private": False, "gated": "manual" if repo.gated else False,
                    "siblings": [{"rfilename": p} for p in sorted(files)]}
            hook = self._hooks.pop(repo_id, None)
            if hook is not None:
                hook()  # NOTE: after the sha is chosen, before it is sent
        return 200, {"Content-Type": "application/json"}, json.dumps(body).encode()

    def _resolve(self, repo_id: str, revision: str, path: str, headers: Any) -> tuple[int, dict[str, str], bytes]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(404, "RepoNotFound")
        if repo.gated and not headers.get("Authorization"):
            return _error(401, "GatedRepo")
        sha = repo.sha_of(revision)
        if sha is None:
            return _error(404, "RevisionNotFound")
        data = repo.commits[sha].get(path)
        if data is None:
            return _error(404, "EntryNotFound")
        etag = f'"{hashlib.sha256(data).hexdigest()}"'
        return 200, {"X-Repo-Commit": sha, "ETag": etag, "Content-Length": str(len(data))}, data


def _error(status: int, code: str) -> tuple[int, dict[str, str], bytes]:
    return status, {"X-Error-Code": code, "Content-Type": "application/json"}, json.dumps({"error": code}).encode()


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, with_body: bool) -> None:
            status, headers, body = hub.answer(self.command, urlsplit(self.path).path, self.headers)
            self.send_response(status)
            headers.setdefault("Content-Length", str(len(body)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_GET(self) -> None:  # http.server calls it by this name
            self._reply(with_body=True)

        def do_HEAD(self) -> None:
            self._reply(with_body=False)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
