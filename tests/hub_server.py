"""A loopback stand-in for the Hugging Face Hub, for the download tests
(HF_ENDPOINT=http://127.0.0.1:PORT).

It answers the endpoints huggingface_hub's snapshot_download and hf_hub_download call (read in
huggingface_hub's _snapshot_download.py, file_download.py, hf_api.py and utils/_http.py), the way
the Hub answers them:
- GET  /api/models/{repo}/revision/{revision}        repo_info: {"id", "sha", "siblings":
[{"rfilename"}], ...}
- GET  /api/models/{repo}/tree/{revision}[/{path}]   list_repo_tree: [{"type": "file", "path",
"size", "oid"}]
- GET  /api/models/{repo}/refs                       list_repo_refs: {"branches": [{"name", "ref",
"targetCommit"}], ...}
- HEAD /{repo}/resolve/{revision}/{filename}         X-Repo-Commit, ETag (X-Linked-Etag/-Size for
LFS files)
- GET  /{repo}/resolve/{revision}/{filename}         the bytes
- GET  /api/agent-harnesses                          an empty registry (huggingface_hub 2.x asks
once a day, for its user agent)
and fails the way the Hub fails, with the X-Error-Code header huggingface_hub reads: RepoNotFound
(401, as
the Hub answers for a missing or private repository), RevisionNotFound (404), EntryNotFound (404,
with the
commit), GatedRepo (401 without a token, 403 with a token that has no access). A gated repository's
listing is public and its files are not, as on the Hub. Every request is recorded, so a test can
check
which files were fetched and that a token was sent; a path the Hub would not know is answered 404
and
recorded in `unknown`.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")
API = re.compile(
    r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)/(?P<kind>revision|tree)/(?P<revision>[^/]+)(?:/(?P<path>.*))?$"
)
REFS = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)/refs$")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<revision>[^/]+)/(?P<path>.+)$")


@dataclass
class Repo:
    """A repository: branch or tag -> commit hash, commit hash -> {file name: bytes}."""

    refs: dict[str, str] = field(default_factory=dict)  # branches
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    gated_token: str | None = None  # set: the repository is gated, and only this token has access

    def add_commit(self, files: dict[str, bytes], *refs: str) -> str:
        sha = hashlib.sha1(
            json.dumps(
                sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items())
            ).encode()
        ).hexdigest()
        self.commits[sha] = dict(files)
        for ref in refs:
            self.refs[ref] = sha
        return sha

    def resolve(self, revision: str) -> str | None:
        return (
            revision
            if revision in self.commits
            else self.refs.get(revision, self.tags.get(revision))
        )


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None


class HubServer:
    """Serve `repos` on 127.0.0.1 (a free port) in a thread; use as a context manager."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.requests: list[Request] = []
        self.unknown: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def downloads(self, repo: str, since: int = 0) -> list[str]:
        """The file paths of `repo` fetched with GET from the resolve endpoint, from request number
        `since` on."""
        prefix = f"/{repo}/resolve/"
        return [
            r.path[len(prefix) :].split("/", 1)[1]
            for r in self.requests[since:]
            if r.method == "GET" and r.path.startswith(prefix)
        ]

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            # quiet: the test asserts on what was requested instead
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._answer(body=True)

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def _send(
                self, status: int, data: bytes = b"", headers: dict | None = None, body: bool = True
            ) -> None:
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _error(self, status: int, code: str, message: str, body: bool, **headers) -> None:
                self._send(
                    status,
                    json.dumps({"error": message}).encode(),
                    {
                        "X-Error-Code": code,
                        "X-Error-Message": message,
                        "Content-Type": "application/json",
                        **headers,
                    },
                    body,
                )

            def _answer(self, body: bool) -> None:
                path = urlsplit(self.path).path
                server.requests.append(
                    Request(self.command, unquote(path), self.headers.get("Authorization"))
                )
                if path == "/api/agent-harnesses":
                    self._send(
                        200,
                        b'{"standardEnvVars": [], "harnesses": {}}',
                        {"Content-Type": "application/json"},
                        body,
                    )
                elif match := REFS.match(path):
                    self._refs(match["repo"], body)
                elif match := API.match(path):
                    self._api(match, body)
                elif match := RESOLVE.match(path):
                    self._resolve(match, body)
                else:
                    server.unknown.append(f"{self.command} {self.path}")
                    self._send(404, b"not found", body=body)

            def _refs(self, name: str, body: bool) -> None:
                repo = server.repos.get(name)
                if repo is None:
                    self._error(401, "RepoNotFound", "Repository not found", body)
                    return
                listed = {
                    kind: [
                        {"name": ref, "ref": f"refs/{prefix}/{ref}", "targetCommit": sha}
                        for ref, sha in refs.items()
                    ]
                    for kind, prefix, refs in (
                        ("branches", "heads", repo.refs),
                        ("tags", "tags", repo.tags),
                    )
                }
                self._send(
                    200,
                    json.dumps({**listed, "converts": []}).encode(),
                    {"Content-Type": "application/json"},
                    body,
                )

            def _lookup(self, match, body: bool):
                repo = server.repos.get(match["repo"])
                if repo is None:
                    self._error(401, "RepoNotFound", "Repository not found", body)
                    return None, None
                sha = repo.resolve(unquote(match["revision"]))
                if sha is None:
                    self._error(404, "RevisionNotFound", "Invalid rev id", body)
                    return None, None
                return repo, sha

            def _api(self, match, body: bool) -> None:
                repo, sha = self._lookup(match, body)
                if repo is None:
                    return
                files = repo.commits[sha]
                if match["kind"] == "revision":
                    info = {
                        "id": match["repo"],
                        "modelId": match["repo"],
                        "sha": sha,
                        "private": False,
                        "gated": "manual" if repo.gated_token else False,
                        "downloads": 0,
                        "likes": 0,
                        "tags": [],
                        "siblings": [{"rfilename": name} for name in files],
                    }
                    self._send(
                        200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body
                    )
                    return
                entries = []
                for name, data in files.items():
                    entry = {
                        "type": "file",
                        "path": name,
                        "size": len(data),
                        "oid": hashlib.sha1(data).hexdigest(),
                    }
                    if name.endswith(LFS_SUFFIXES):
                        entry["lfs"] = {
                            "oid": hashlib.sha256(data).hexdigest(),
                            "size": len(data),
                            "pointerSize": 134,
                        }
                    entries.append(entry)
                self._send(
                    200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, body
                )

            def _resolve(self, match, body: bool) -> None:
                repo, sha = self._lookup(match, body)
                if repo is None:
                    return
                if repo.gated_token is not None:
                    sent = self.headers.get("Authorization")
                    if sent != f"Bearer {repo.gated_token}":
                        message = (
                            "Access to this model is restricted. You must have access to it and "
                            "be authenticated."
                        )
                        self._error(401 if sent is None else 403, "GatedRepo", message, body)
                        return
                name = unquote(match["path"])
                data = repo.commits[sha].get(name)
                if data is None:
                    self._error(
                        404, "EntryNotFound", "Entry not found", body, **{"X-Repo-Commit": sha}
                    )
                    return
                headers = {
                    "X-Repo-Commit": sha,
                    "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                    "Content-Type": "application/octet-stream",
                }
                if name.endswith(LFS_SUFFIXES):
                    headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
                    headers["X-Linked-Size"] = str(len(data))
                self._send(200, data, headers, body)

        return Handler
