"""A tiny in-memory Hugging Face Hub for tests (loopback only).

It implements exactly the part of the Hub HTTP protocol that ``huggingface_hub`` (2.x) uses for
``create_repo``, ``repo_info``/``model_info``/``dataset_info`` (with the card's metadata as ``cardData`` and the tags
the Hub derives from it), ``list_models`` (``GET /api/models``: tag ``filter``s, ``search``, ``author``,
``cardData``), ``list_repo_files``/``list_repo_tree`` (hence ``verify_repo_checksums``), ``list_repo_refs``,
``create_branch``, ``create_commit`` (validate-yaml, preupload, ndjson commit with base64 "regular" files, refused
with 412 when ``parentCommit`` is not the branch head) and ``hf_hub_download``/``snapshot_download`` (HEAD/GET
``/{repo}/resolve/{revision}/{path}``, ``/datasets/{repo}/resolve/...`` for datasets).

Model and dataset repos, ids ``namespace/name``. Every commit gets a fresh 40-hex sha and keeps its own file
table, so old revisions stay downloadable by sha and by branch name. Preupload always answers
``"uploadMode": "regular"`` (no LFS / Xet), so file contents travel base64-encoded inside the commit payload. A
create-repo request without a visibility gets the organisation's default (``LocalHub(private_namespaces=...)``), as
on the Hub; ``server.create_repo_payloads`` keeps what each one sent.

Fault injection (for tests):

- ``server.fail_next("commit", status=500)`` (or ``server.fail_next_commit()``): the next request(s) to that
  route answer an HTTP error and change nothing. Routes: ``create_repo``, ``info``, ``tree``, ``refs``,
  ``branch``, ``validate_yaml``, ``preupload``, ``commit``, ``resolve``.
- ``server.corrupt_file(repo_id, path, mode)`` serves bad bytes for that file (any revision), while the repo
  metadata (tree listing ``oid``/``size``, ``ETag``) still describes the real file:

  * ``"tamper"``: same length, one byte flipped near the end (inside the tensor data of a safetensors file),
    HEAD/GET headers consistent -> ``huggingface_hub`` accepts it (it only checks sizes).
  * ``"truncate"``: first half of the bytes, HEAD and GET both advertise the truncated length (a server that
    stores a truncated blob) -> ``huggingface_hub`` accepts it.
  * ``"short_read"``: HEAD advertises the full length, GET sends only half (with an honest Content-Length)
    -> ``huggingface_hub`` raises ``OSError("Consistency check failed ...")``.
  * ``"replace"``: other bytes (``content``), with headers consistent with them -> ``huggingface_hub`` accepts them
    when they have the real file's length (a tampered config with one value changed).
- ``server.drop_connection(route, after_bytes=..., after_apply=...)``: the next request(s) to that route lose their
  connection mid-transfer (an upload cut mid-body, a download cut mid-body, or a commit that lands but whose answer
  is lost; see the method).

Private repos answer 401 "RepoNotFound" to requests without a bearer token (any token is accepted unless
``LocalHub(valid_tokens=...)``); ``LocalHub(require_token_for_writes=True)`` also requires one for writes.
``server.requests`` logs every request (method, path, route, status, authorized).

Use it through the ``hub_server`` pytest fixture below, which also points ``huggingface_hub`` at the server
(see :func:`patch_hub_constants` for which constants and why), isolates HF_HOME (cache, token) in a temp dir
and blocks any non-loopback request. ``tests/conftest.py`` puts ``tests/support/`` on ``sys.path``, so a test module
(or ``tests/conftest.py``, to share it with every module) enables the fixture with::

    from hub_server import hub_server  # noqa: F401
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

__all__ = [
    "LocalHub",
    "HubRequest",
    "HubFixture",
    "git_blob_sha1",
    "patch_hub_constants",
    "loopback_only_client",
    "LoopbackOnlyError",
    "hub_server",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_CORRUPTION_MODES = ("tamper", "truncate", "short_read", "replace")
_ROUTES = ("create_repo", "info", "tree", "refs", "branch", "validate_yaml", "preupload", "commit", "resolve", "list")
_REPO_TYPES = ("model", "dataset")


def repo_key(repo_id: str, repo_type: str = "model") -> str:
    """Where the server files a repo: its id for a model, ``datasets/<id>`` for a dataset (the Hub's URL form)."""
    if repo_type not in _REPO_TYPES:
        raise ValueError(f"LocalHub serves {_REPO_TYPES} repos, not {repo_type!r}")
    return repo_id if repo_type == "model" else f"{repo_type}s/{repo_id}"


def card_metadata(readme: bytes | None) -> dict[str, Any]:
    """The YAML front matter of a README (``{}`` without one), as the Hub reads it into ``cardData``."""
    import yaml

    text = (readme or b"").decode("utf-8", errors="replace")
    match = re.match(r"\A---\r?\n(.*?)\r?\n---\r?\n", text, re.S)
    if not match:
        return {}
    data = yaml.safe_load(match.group(1))
    return data if isinstance(data, dict) else {}


def hub_tags(metadata: dict[str, Any]) -> list[str]:
    """The tags the Hub lists (and filters on) for a model whose card holds ``metadata``: the card's own tags, the
    library, ``base_model:<id>`` and ``base_model:<relation>:<id>``, ``license:<id>`` and ``dataset:<id>``."""

    def listed(value: Any) -> list[str]:
        return [str(v) for v in (value if isinstance(value, list) else [value] if value else [])]

    tags = listed(metadata.get("tags")) + listed(metadata.get("library_name"))
    relation = metadata.get("base_model_relation")
    for base in listed(metadata.get("base_model")):
        tags.append(f"base_model:{base}")
        if relation:
            tags.append(f"base_model:{relation}:{base}")
    tags += [f"license:{value}" for value in listed(metadata.get("license"))]
    tags += [f"dataset:{value}" for value in listed(metadata.get("datasets"))]
    return list(dict.fromkeys(tags))



def git_blob_sha1(data: bytes) -> str:
    """Git blob id of ``data`` (what the Hub reports as ``oid``/``ETag`` for regular, non-LFS files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclasses.dataclass
class _Commit:
    oid: str
    parent: str | None
    files: dict[str, str]  # path -> blob id (git sha1); blob bytes live in LocalHub._blobs
    title: str
    message: str
    date: str


@dataclasses.dataclass
class _Repo:
    repo_id: str
    private: bool
    created_at: str
    repo_type: str = "model"
    branches: dict[str, str] = dataclasses.field(default_factory=dict)  # branch / "refs/pr/N" -> commit oid
    commits: dict[str, _Commit] = dataclasses.field(default_factory=dict)
    n_prs: int = 0


@dataclasses.dataclass(frozen=True)
class HubRequest:
    """One request received by the server (for assertions in tests)."""

    method: str
    path: str
    route: str | None
    status: int
    authorized: bool


@dataclasses.dataclass(frozen=True)
class _Drop:
    after_bytes: int
    after_apply: bool
    path: str | None = None


class _ConnectionDropped(Exception):
    """Raised inside a handler to cut the connection without an answer (a fault injected by the test)."""


class _HttpError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code
        self.headers = headers or {}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


class LocalHub:
    """In-memory Hub served on ``127.0.0.1`` at an ephemeral port.

    Use as a context manager (or call :meth:`start` / :meth:`stop`). ``endpoint`` is the base URL to give
    ``huggingface_hub`` (``HF_ENDPOINT``).

    Args:
        valid_tokens: if given, only these bearer tokens are accepted (others get 401). Otherwise any token is.
        require_token_for_writes: if True, writes (create repo / branch, preupload, commit) need a token.
        private_namespaces: organisations whose new repos are private by default, as an organisation can set on the
            Hub: a create-repo request without a visibility gets a private repo there.
    """

    def __init__(
        self,
        *,
        valid_tokens: set[str] | None = None,
        require_token_for_writes: bool = False,
        private_namespaces: set[str] | None = None,
    ) -> None:
        self.valid_tokens = valid_tokens
        self.require_token_for_writes = require_token_for_writes
        self.private_namespaces = set(private_namespaces or ())
        self.requests: list[HubRequest] = []
        self.create_repo_payloads: list[dict[str, Any]] = []  # the JSON bodies of create-repo requests, in order
        self._drops: dict[str, list[_Drop]] = {}
        self._repos: dict[str, _Repo] = {}
        self._blobs: dict[str, bytes] = {}
        self._lock = threading.RLock()
        self._counter = itertools.count()
        self._failures: dict[str, list[tuple[int, str]]] = {}
        self._corruptions: dict[tuple[str, str], str] = {}
        self._replacements: dict[tuple[str, str], bytes] = {}
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def endpoint(self) -> str:
        if self._httpd is None:
            raise RuntimeError("LocalHub is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "LocalHub":
        if self._httpd is not None:
            return self
        hub = self

        class Handler(_HubHandler):
            pass

        Handler.hub = hub
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        httpd.daemon_threads = True
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="local-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (idempotent). Pending keep-alive handler threads are daemons and time out on their own."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "LocalHub":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ fault injection
    def fail_next(self, route: str, *, status: int = 500, count: int = 1, message: str = "Injected failure") -> None:
        """Make the next ``count`` requests to ``route`` answer ``status`` without changing any state."""
        if route not in _ROUTES:
            raise ValueError(f"Unknown route {route!r}, expected one of {_ROUTES}")
        with self._lock:
            self._failures.setdefault(route, []).extend([(status, message)] * count)

    def fail_next_commit(self, status: int = 500) -> None:
        self.fail_next("commit", status=status)

    def corrupt_file(self, repo_id: str, path: str, mode: str = "tamper", content: bytes = b"") -> None:
        """Serve corrupted content for ``path`` of ``repo_id`` (every revision) until :meth:`clear_faults`."""
        if mode not in _CORRUPTION_MODES:
            raise ValueError(f"Unknown corruption mode {mode!r}, expected one of {_CORRUPTION_MODES}")
        with self._lock:
            self._corruptions[(repo_id, path)] = mode
            self._replacements[(repo_id, path)] = content

    def drop_connection(
        self, route: str, *, after_bytes: int = 0, after_apply: bool = False, count: int = 1, path: str | None = None
    ) -> None:
        """Cut the connection of the next ``count`` requests to ``route`` mid-transfer, as a network that drops does
        (for ``resolve``: GET requests only, of the file ``path`` when given).

        - an upload (``commit``, ``preupload``): the server reads ``after_bytes`` bytes of the request body and closes
          the connection without answering; nothing is applied. With ``after_apply=True`` it applies the request in
          full (the commit lands) and closes the connection before the answer leaves.
        - a download (``resolve``, GET): the server sends the headers (with the full ``Content-Length``) and the first
          ``after_bytes`` bytes of the body, then closes the connection.
        """
        if route not in _ROUTES:
            raise ValueError(f"Unknown route {route!r}, expected one of {_ROUTES}")
        with self._lock:
            self._drops.setdefault(route, []).extend([_Drop(after_bytes, after_apply, path)] * count)

    def clear_faults(self) -> None:
        with self._lock:
            self._failures.clear()
            self._corruptions.clear()
            self._drops.clear()

    # ------------------------------------------------------------------ direct (non-HTTP) helpers for tests
    def _repo(self, repo_id: str, repo_type: str) -> _Repo:
        return self._repos[repo_key(repo_id, repo_type)]

    def repo_exists(self, repo_id: str, repo_type: str = "model") -> bool:
        with self._lock:
            return repo_key(repo_id, repo_type) in self._repos

    def is_private(self, repo_id: str, repo_type: str = "model") -> bool:
        with self._lock:
            return self._repo(repo_id, repo_type).private

    def branches(self, repo_id: str, repo_type: str = "model") -> dict[str, str]:
        with self._lock:
            return dict(self._repo(repo_id, repo_type).branches)

    def head(self, repo_id: str, branch: str = "main", repo_type: str = "model") -> str:
        with self._lock:
            return self._repo(repo_id, repo_type).branches[branch]

    def commit_count(self, repo_id: str, repo_type: str = "model") -> int:
        with self._lock:
            return len(self._repo(repo_id, repo_type).commits)

    def commit_parent(self, repo_id: str, oid: str, repo_type: str = "model") -> str | None:
        with self._lock:
            return self._repo(repo_id, repo_type).commits[oid].parent

    def list_files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> list[str]:
        with self._lock:
            repo = self._repo(repo_id, repo_type)
            return sorted(repo.commits[self._resolve(repo, revision)].files)

    def get_file(self, repo_id: str, path: str, revision: str = "main", repo_type: str = "model") -> bytes:
        with self._lock:
            repo = self._repo(repo_id, repo_type)
            return self._blobs[repo.commits[self._resolve(repo, revision)].files[path]]

    def metadata(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, Any]:
        """The card metadata (README front matter) of a revision, as the Hub serves it in ``cardData``."""
        with self._lock:
            repo = self._repo(repo_id, repo_type)
            return self._card_metadata(repo, self._resolve(repo, revision))

    def requests_to(self, route: str) -> list[HubRequest]:
        return [r for r in list(self.requests) if r.route == route]

    # ------------------------------------------------------------------ internals
    def _take_failure(self, route: str) -> tuple[int, str] | None:
        with self._lock:
            queue = self._failures.get(route)
            return queue.pop(0) if queue else None

    def _take_drop(self, route: str, method: str, path: str) -> _Drop | None:
        """The next drop planned for this request, if any (a download's drop waits for a GET of its file)."""
        with self._lock:
            queue = self._drops.get(route)
            if not queue:
                return None
            if route == "resolve" and (method != "GET" or queue[0].path not in (None, path)):
                return None
            return queue.pop(0)

    def _card_metadata(self, repo: _Repo, oid: str) -> dict[str, Any]:
        blob_id = repo.commits[oid].files.get("README.md")
        return card_metadata(self._blobs[blob_id] if blob_id else None)

    def _new_oid(self, *parts: str) -> str:
        salt = f"{next(self._counter)}:{time.time_ns()}"
        return hashlib.sha1("\n".join((salt, *parts)).encode()).hexdigest()

    def _make_commit(self, repo: _Repo, parent: str | None, files: dict[str, str], title: str, message: str) -> str:
        listing = "\n".join(f"{p}:{b}" for p, b in sorted(files.items()))
        oid = self._new_oid(repo.repo_id, parent or "", listing, title, message)
        repo.commits[oid] = _Commit(
            oid=oid, parent=parent, files=dict(files), title=title, message=message, date=_now()
        )
        return oid

    def _store_blob(self, data: bytes) -> str:
        blob_id = git_blob_sha1(data)
        self._blobs[blob_id] = data
        return blob_id

    @staticmethod
    def _resolve(repo: _Repo, revision: str) -> str:
        if revision in repo.branches:
            return repo.branches[revision]
        if revision in repo.commits:
            return revision
        if re.fullmatch(r"[0-9a-f]{7,39}", revision):
            matches = [oid for oid in repo.commits if oid.startswith(revision)]
            if len(matches) == 1:
                return matches[0]
        raise _HttpError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _create_repo(self, repo_id: str, private: bool, repo_type: str = "model") -> tuple[bool, _Repo]:
        key = repo_key(repo_id, repo_type)
        with self._lock:
            if key in self._repos:
                return False, self._repos[key]
            repo = _Repo(repo_id=repo_id, private=private, created_at=_now(), repo_type=repo_type)
            # Like the real Hub: a new repo starts with one commit holding a .gitattributes file.
            gitattributes = self._store_blob(b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
            initial = {".gitattributes": gitattributes}
            repo.branches["main"] = self._make_commit(repo, None, initial, "initial commit", "")
            self._repos[key] = repo
            return True, repo


class _HubHandler(BaseHTTPRequestHandler):
    hub: LocalHub
    protocol_version = "HTTP/1.1"
    timeout = 10  # idle keep-alive connections give their handler thread back after this many seconds
    server_version = "LocalHub/1.0"

    # silence default stderr logging
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    # ------------------------------------------------------------------ plumbing
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _json_body(self) -> Any:
        body = self._read_body()
        if not body:
            return {}
        try:
            return json.loads(body)
        except ValueError:
            raise _HttpError(400, "Invalid JSON body") from None

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip() or None
        return None

    def _check_token(self) -> str | None:
        token = self._token()
        if token is not None and self.hub.valid_tokens is not None and token not in self.hub.valid_tokens:
            raise _HttpError(401, "Invalid credentials in Authorization header")
        return token

    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        *,
        length: int | None = None,
        logged: bool = True,
    ) -> None:
        # Logged before the response leaves: a client that checks `requests_to(...)` right after its call returns
        # must find it (logging after the write raced with the client's next line). A response cut short is logged
        # by `_drop`, with the status 0.
        if logged:
            self.hub.requests.append(
                HubRequest(
                    self.command, urlsplit(self.path).path, self._route, status, authorized=self._token() is not None
                )
            )
        self.send_response(status)
        headers = dict(headers or {})
        headers.setdefault("Content-Type", "application/json")
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), headers)

    def _dispatch(self, method: str) -> None:
        self._route: str | None = None
        self._pending_drop: _Drop | None = None
        raw_path = urlsplit(self.path).path
        try:
            self._check_token()
            self._handle(method, raw_path, parse_qs(urlsplit(self.path).query))
        except _ConnectionDropped:
            self._drop()
        except _HttpError as err:
            headers = {"X-Error-Message": err.message, **err.headers}
            if err.error_code:
                headers["X-Error-Code"] = err.error_code
            self._send_json(err.status, {"error": err.message}, headers)
        except Exception as err:  # pragma: no cover - a bug in the test server
            self._send_json(500, {"error": f"LocalHub internal error: {err!r}"})

    # ------------------------------------------------------------------ routing
    def _handle(self, method: str, raw_path: str, query: dict[str, list[str]]) -> None:
        seg = raw_path.strip("/").split("/")
        if seg[:1] == ["api"]:
            if seg[1:] == ["repos", "create"] and method == "POST":
                return self._guarded("create_repo", self._create_repo)
            if seg[1:] == ["validate-yaml"] and method == "POST":
                return self._guarded("validate_yaml", self._validate_yaml)
            if seg[1:] == ["whoami-v2"] and method == "GET":
                if self._token() is None:
                    raise _HttpError(401, "Invalid credentials in Authorization header")
                return self._send_json(200, {"type": "user", "name": "local-user", "orgs": [], "auth": {}})
            if seg[1:] == ["models"] and method == "GET":
                return self._guarded("list", lambda: self._list_models(query))
            if len(seg) >= 4 and seg[1] in ("models", "datasets"):
                key = repo_key(f"{unquote(seg[2])}/{unquote(seg[3])}", seg[1][:-1])
                rest = [unquote(s) for s in seg[4:]]
                return self._repo_api(method, key, rest, query)
            if len(seg) >= 2 and seg[1] in ("spaces", "kernels"):
                raise _HttpError(400, "LocalHub only serves model and dataset repos")
        prefix = 1 if seg[:1] == ["datasets"] else 0
        if len(seg) >= 4 + prefix and seg[2 + prefix] == "resolve" and method in ("GET", "HEAD"):
            key = repo_key(f"{unquote(seg[prefix])}/{unquote(seg[prefix + 1])}", "dataset" if prefix else "model")
            revision = unquote(seg[3 + prefix])
            path = "/".join(unquote(s) for s in seg[4 + prefix :])
            return self._guarded("resolve", lambda: self._resolve_file(key, revision, path))
        raise _HttpError(404, f"LocalHub: no route for {method} {raw_path}")

    def _guarded(self, route: str, fn) -> None:
        self._route = route
        failure = self.hub._take_failure(route)
        if failure is not None:
            status, message = failure
            self._read_body()  # drain the request so the connection stays usable
            raise _HttpError(status, message)
        file_path = urlsplit(self.path).path.split("/resolve/", 1)[-1].split("/", 1)[-1]
        self._pending_drop = self.hub._take_drop(route, self.command, unquote(file_path))
        if self._pending_drop is not None and not self._pending_drop.after_apply and self.command != "GET":
            # An upload cut mid-body: part of the request arrives, then the connection is gone.
            self.rfile.read(min(self._pending_drop.after_bytes, int(self.headers.get("Content-Length") or 0)))
            raise _ConnectionDropped
        fn()

    def _drop(self) -> None:
        """Close the connection at once, answering nothing more (logged with the status 0)."""
        self.hub.requests.append(
            HubRequest(self.command, urlsplit(self.path).path, self._route, 0, authorized=self._token() is not None)
        )
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    def _repo_api(self, method: str, repo_id: str, rest: list[str], query: dict[str, list[str]]) -> None:
        # repo_id: the repo's key (`repo_key`): "ns/name" for a model, "datasets/ns/name" for a dataset.
        if not rest and method == "GET":
            return self._guarded("info", lambda: self._info(repo_id, "main", query))
        if len(rest) == 2 and rest[0] == "revision" and method == "GET":
            return self._guarded("info", lambda: self._info(repo_id, rest[1], query))
        if len(rest) >= 2 and rest[0] == "tree" and method == "GET":
            return self._guarded("tree", lambda: self._tree(repo_id, rest[1], "/".join(rest[2:]), query))
        if rest == ["refs"] and method == "GET":
            return self._guarded("refs", lambda: self._refs(repo_id))
        if len(rest) == 2 and rest[0] == "branch" and method in ("POST", "DELETE"):
            return self._guarded("branch", lambda: self._branch(method, repo_id, rest[1]))
        if len(rest) == 2 and rest[0] == "preupload" and method == "POST":
            return self._guarded("preupload", lambda: self._preupload(repo_id, rest[1]))
        if len(rest) == 2 and rest[0] == "commit" and method == "POST":
            return self._guarded("commit", lambda: self._commit(repo_id, rest[1], query))
        raise _HttpError(404, f"LocalHub: no route for {method} /api/{repo_id}/{'/'.join(rest)}")

    # ------------------------------------------------------------------ access helpers
    def _get_repo(self, repo_id: str, *, write: bool = False) -> _Repo:
        token = self._token()
        if write and self.hub.require_token_for_writes and token is None:
            raise _HttpError(401, "You must be authenticated to write to a repo")
        repo = self.hub._repos.get(repo_id)
        if repo is None or (repo.private and token is None):
            # Same answer for "missing" and "private without auth", like the real Hub.
            raise _HttpError(401 if token is None else 404, "Repository not found", "RepoNotFound")
        return repo

    # ------------------------------------------------------------------ handlers
    def _create_repo(self) -> None:
        payload = self._json_body()
        if self.hub.require_token_for_writes and self._token() is None:
            raise _HttpError(401, "You must be authenticated to create a repo")
        self.hub.create_repo_payloads.append(dict(payload))
        repo_type = payload.get("type") or "model"
        if repo_type not in _REPO_TYPES:
            raise _HttpError(400, "LocalHub only serves model and dataset repos")
        name = payload.get("name") or ""
        namespace = payload.get("organization") or "local-user"
        if not (_NAME_RE.fullmatch(name) and _NAME_RE.fullmatch(namespace)) or "--" in name or ".." in name:
            raise _HttpError(400, f"Invalid repo name: {namespace}/{name}")
        repo_id = f"{namespace}/{name}"
        visibility = payload.get("visibility")
        if visibility is None and "private" in payload:
            visibility = "private" if payload["private"] else "public"
        # No visibility asked for: the organisation's default, as on the Hub.
        private = visibility == "private" or (visibility is None and namespace in self.hub.private_namespaces)
        created, _ = self.hub._create_repo(repo_id, private, repo_type)
        url = f"{self.hub.endpoint}/{repo_key(repo_id, repo_type)}"
        if not created:
            return self._send_json(409, {"error": "You already created this model repo", "url": url})
        self._send_json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _validate_yaml(self) -> None:
        payload = self._json_body()
        content = payload.get("content") or ""
        if content.startswith("---") and "\n---" not in content[3:]:
            return self._send_json(400, {"errors": [{"message": "Unterminated YAML front matter"}], "warnings": []})
        self._send_json(200, {"errors": [], "warnings": []})

    def _info(self, repo_id: str, revision: str, query: dict[str, list[str]]) -> None:
        with self.hub._lock:
            repo = self._get_repo(repo_id)
            commit = repo.commits[self.hub._resolve(repo, revision)]
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            siblings = []
            for path in sorted(commit.files):
                sibling: dict[str, Any] = {"rfilename": path}
                if blobs:
                    sibling.update(size=len(self.hub._blobs[commit.files[path]]), blobId=commit.files[path])
                siblings.append(sibling)
            self._send_json(200, {**self._summary(repo, commit.oid, card_data=True), "siblings": siblings})

    def _summary(self, repo: _Repo, oid: str, *, card_data: bool) -> dict[str, Any]:
        """What the Hub's repo info and model listing say about a repo at commit ``oid``."""
        metadata = self.hub._card_metadata(repo, oid)
        summary: dict[str, Any] = {
            "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": oid,
            "lastModified": repo.commits[oid].date,
            "createdAt": repo.created_at,
            "private": repo.private,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": hub_tags(metadata),
        }
        if repo.repo_type == "model":
            summary["modelId"] = repo.repo_id
            if metadata.get("library_name"):
                summary["library_name"] = metadata["library_name"]
            if metadata.get("pipeline_tag"):
                summary["pipeline_tag"] = metadata["pipeline_tag"]
        if card_data and metadata:
            summary["cardData"] = metadata
        return summary

    def _list_models(self, query: dict[str, list[str]]) -> None:
        """GET /api/models: the model repos holding every ``filter`` tag (and matching ``search`` / ``author``),
        newest first, with ``cardData`` when asked; private repos only with a token."""
        wanted = set(query.get("filter", []))
        search = (query.get("search") or [""])[0].lower()
        author = (query.get("author") or [None])[0]
        limit = int((query.get("limit") or ["1000"])[0])
        with_card = (query.get("cardData") or ["false"])[0].lower() == "true" or "cardData" in query.get("expand", [])
        token = self._token()
        found = []
        with self.hub._lock:
            for repo in self.hub._repos.values():
                if repo.repo_type != "model" or (repo.private and token is None):
                    continue
                summary = self._summary(repo, repo.branches["main"], card_data=with_card)
                if not wanted <= set(summary["tags"]):
                    continue
                if search not in repo.repo_id.lower() or (author and summary["author"] != author):
                    continue
                found.append(summary)
        found.sort(key=lambda item: item["createdAt"], reverse=True)
        self._send_json(200, found[:limit])

    def _tree(self, repo_id: str, revision: str, prefix: str, query: dict[str, list[str]]) -> None:
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        with self.hub._lock:
            repo = self._get_repo(repo_id)
            commit = repo.commits[self.hub._resolve(repo, revision)]
            base = prefix.strip("/")
            files = {p: b for p, b in commit.files.items() if not base or p.startswith(base + "/")}
            if base and not files:
                raise _HttpError(404, f"Entry not found: {base}", "EntryNotFound", {"X-Repo-Commit": commit.oid})
            entries: dict[str, dict[str, Any]] = {}
            for path, blob_id in sorted(files.items()):
                rel = path[len(base) + 1 :] if base else path
                parts = rel.split("/")
                for depth in range(1, len(parts)):
                    if not recursive and depth > 1:
                        break
                    folder = "/".join(([base] if base else []) + parts[:depth])
                    folder_oid = hashlib.sha1(folder.encode()).hexdigest()
                    entries.setdefault(folder, {"type": "directory", "oid": folder_oid, "size": 0, "path": folder})
                if recursive or len(parts) == 1:
                    size = len(self.hub._blobs[blob_id])
                    entries[path] = {"type": "file", "oid": blob_id, "size": size, "path": path}
            self._send_json(200, list(entries.values()))

    def _refs(self, repo_id: str) -> None:
        with self.hub._lock:
            repo = self._get_repo(repo_id)
            branches = [
                {"name": name, "ref": f"refs/heads/{name}", "targetCommit": oid}
                for name, oid in repo.branches.items()
                if not name.startswith("refs/")
            ]
            self._send_json(200, {"branches": branches, "converts": [], "tags": []})

    def _branch(self, method: str, repo_id: str, branch: str) -> None:
        payload = self._json_body()
        with self.hub._lock:
            repo = self._get_repo(repo_id, write=True)
            if method == "DELETE":
                if branch not in repo.branches or branch == "main":
                    raise _HttpError(400 if branch == "main" else 404, f"Cannot delete branch {branch}")
                del repo.branches[branch]
                return self._send_json(200, {})
            if not branch or branch.startswith("refs/") or _SHA_RE.fullmatch(branch) or ".." in branch:
                raise _HttpError(400, f"Invalid branch name: {branch}")
            if branch in repo.branches:
                raise _HttpError(409, f"Reference already exists: {branch}")
            start = payload.get("startingPoint") or "main"
            repo.branches[branch] = self.hub._resolve(repo, start)
            self._send_json(200, {})

    def _preupload(self, repo_id: str, revision: str) -> None:
        payload = self._json_body()
        with self.hub._lock:
            repo = self._get_repo(repo_id, write=True)
            commit = repo.commits[self.hub._resolve(repo, revision)]
            files = []
            for item in payload.get("files", []):
                path = item["path"]
                files.append(
                    {"path": path, "uploadMode": "regular", "shouldIgnore": False, "oid": commit.files.get(path)}
                )
            self._send_json(200, {"files": files, "commitOid": commit.oid})

    def _commit(self, repo_id: str, revision: str, query: dict[str, list[str]]) -> None:
        body = self._read_body()
        create_pr = query.get("create_pr", ["0"])[0] in ("1", "true", "True")
        try:
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        except ValueError:
            raise _HttpError(400, "Invalid ndjson payload") from None
        if not lines or lines[0].get("key") != "header":
            raise _HttpError(400, "First ndjson line must be the commit header")
        header = lines[0]["value"]
        with self.hub._lock:
            repo = self._get_repo(repo_id, write=True)
            if revision not in repo.branches:
                raise _HttpError(404, f"Invalid rev id: {revision} (commits go to branches)", "RevisionNotFound")
            head = repo.branches[revision]
            parent_commit = header.get("parentCommit")
            if parent_commit and not head.startswith(parent_commit):
                raise _HttpError(412, f"Parent commit {parent_commit} is not the head of {revision} ({head})")
            files = dict(repo.commits[head].files)
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value") or {}
                path = str(value.get("path", ""))
                if not path or path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/")):
                    raise _HttpError(400, f"Invalid path in commit: {path!r}")
                if key == "file":
                    if value.get("encoding") != "base64":
                        raise _HttpError(400, "Only base64 encoded files are supported")
                    files[path] = self.hub._store_blob(base64.b64decode(value["content"]))
                elif key == "deletedFile":
                    if files.pop(path, None) is None:
                        raise _HttpError(404, "A file with this name doesn't exist", "EntryNotFound")
                elif key == "deletedFolder":
                    prefix = path.rstrip("/") + "/"
                    for existing in [p for p in files if p.startswith(prefix)]:
                        del files[existing]
                elif key in ("lfsFile", "lfsFiles"):
                    raise _HttpError(400, "LocalHub does not support LFS uploads (preupload answers 'regular')")
                else:
                    raise _HttpError(400, f"Unsupported commit operation: {key!r}")
            oid = self.hub._make_commit(repo, head, files, header.get("summary", ""), header.get("description", ""))
            pr_url = None
            if create_pr:
                repo.n_prs += 1
                repo.branches[f"refs/pr/{repo.n_prs}"] = oid
                pr_url = f"{self.hub.endpoint}/{repo_id}/discussions/{repo.n_prs}"
            else:
                repo.branches[revision] = oid
            if self._pending_drop is not None:
                raise _ConnectionDropped  # the commit landed; its answer is lost with the connection
            self._send_json(
                200,
                {
                    "success": True,
                    "commitOid": oid,
                    "commitUrl": f"{self.hub.endpoint}/{repo_id}/commit/{oid}",
                    "pullRequestUrl": pr_url,
                },
            )

    def _resolve_file(self, repo_id: str, revision: str, path: str) -> None:
        with self.hub._lock:
            repo = self._get_repo(repo_id)
            oid = self.hub._resolve(repo, revision)
            blob_id = repo.commits[oid].files.get(path)
            if blob_id is None:
                raise _HttpError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": oid})
            data = self.hub._blobs[blob_id]
            mode = self.hub._corruptions.get((repo_id, path))
            replacement = self.hub._replacements.get((repo_id, path), b"")
        advertised = len(data)
        if mode == "tamper" and data:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        elif mode == "truncate":
            data = data[: len(data) // 2]
            advertised = len(data)
        elif mode == "replace":
            data = replacement
            advertised = len(data)
        elif mode == "short_read" and self.command == "GET":
            data = data[: len(data) // 2]
            advertised = len(data)  # honest framing: the client sees a complete, but too short, response
        headers = {
            "Content-Type": "application/octet-stream",
            "X-Repo-Commit": oid,
            "ETag": f'"{blob_id}"',
            "Accept-Ranges": "bytes",
        }
        status = 200
        range_header = self.headers.get("Range")
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header or "")
        if self.command == "GET" and match:
            start = int(match[1])
            end = int(match[2]) if match[2] else len(data) - 1
            if start >= len(data) and len(data) > 0:
                raise _HttpError(416, "Range not satisfiable")
            headers["Content-Range"] = f"bytes {start}-{min(end, len(data) - 1)}/{len(data)}"
            data = data[start : end + 1]
            advertised = len(data)
            status = 206
        if self._pending_drop is not None and self.command == "GET":
            # A download cut mid-body: the full length was announced, part of the bytes arrive.
            self._send(status, data[: self._pending_drop.after_bytes], headers, length=advertised, logged=False)
            raise _ConnectionDropped
        self._send(status, data, headers, length=advertised)


# ---------------------------------------------------------------------------------------------- client wiring
@contextlib.contextmanager
def patch_hub_constants(endpoint: str, hf_home: str | os.PathLike[str]) -> Iterator[None]:
    """Point an already-imported ``huggingface_hub`` at ``endpoint`` and an isolated ``hf_home``.

    ``huggingface_hub`` reads ``HF_ENDPOINT``/``HF_HOME``/``HF_HUB_OFFLINE``... once, at import time, into
    ``huggingface_hub.constants``; the client reads those module attributes at *call* time, so patching them
    is enough in-process (for a subprocess, set the env vars instead, see :meth:`HubFixture.subprocess_env`):

    - ``ENDPOINT``: default endpoint of every ``HfApi()`` created afterwards (``HfApi.endpoint``), hence of
      create_repo / repo_info / tree / preupload / commit / validate-yaml. NB: the module-level functions
      (``huggingface_hub.create_repo``...) are bound to an ``HfApi`` built at import time and keep the old
      endpoint: use ``HfApi()`` (as ``focus_hf.hub`` does) or pass ``endpoint=``. Libraries do call them
      (PEFT's ``load_peft_weights`` calls ``huggingface_hub.file_exists``), so the endpoint of that shared
      ``huggingface_hub.hf_api.api`` object is patched too.
    - ``HUGGINGFACE_CO_URL_TEMPLATE``: ``hf_hub_url`` builds download URLs from it (not from ``ENDPOINT``),
      so ``hf_hub_download``/``snapshot_download`` would still go to huggingface.co without it.
    - ``HF_HUB_OFFLINE``: read by ``constants.is_offline_mode()``, which blocks every request; forced False.
    - ``HF_HUB_DISABLE_TELEMETRY``: with telemetry on, building the user agent fetches an "agent harnesses"
      registry from ``ENDPOINT`` and caches it under ``HF_HOME``; turned off to keep requests and files tidy.
    - ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_ASSETS_CACHE``, ``HF_XET_CACHE``, ``HF_TOKEN_PATH``,
      ``HF_STORED_TOKENS_PATH``, ``AGENT_HARNESSES_PATH``: isolate cache and credentials under ``hf_home``
      (no real token is read or sent; ``HF_TOKEN``/``HUGGING_FACE_HUB_TOKEN`` env vars must be unset too).

    ``HF_URL_HOSTS`` and ``utils._http._HUB_ORIGINS`` (also derived from the import-time endpoint) only matter
    for following redirects and parsing web URLs; this server never redirects, so they are left alone.
    """
    from huggingface_hub import constants

    hf_home = os.fspath(hf_home)
    endpoint = endpoint.rstrip("/")
    new_values = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HOME": hf_home,
        "HF_HUB_CACHE": os.path.join(hf_home, "hub"),
        "HF_ASSETS_CACHE": os.path.join(hf_home, "assets"),
        "HF_XET_CACHE": os.path.join(hf_home, "xet"),
        "HF_TOKEN_PATH": os.path.join(hf_home, "token"),
        "HF_STORED_TOKENS_PATH": os.path.join(hf_home, "stored_tokens"),
        "AGENT_HARNESSES_PATH": os.path.join(hf_home, ".agent_harnesses.json"),
    }
    from huggingface_hub import hf_api

    missing = object()
    old_values = {name: getattr(constants, name, missing) for name in new_values}
    old_api_endpoint = hf_api.api.endpoint
    for name, value in new_values.items():
        setattr(constants, name, value)
    hf_api.api.endpoint = endpoint
    try:
        yield
    finally:
        hf_api.api.endpoint = old_api_endpoint
        for name, value in old_values.items():
            if value is missing:
                delattr(constants, name)
            else:
                setattr(constants, name, value)


@dataclasses.dataclass
class HubFixture:
    """What the ``hub_server`` fixture yields: the running :class:`LocalHub` plus the isolated client paths."""

    hub: LocalHub
    hf_home: Path
    refused_urls: list[str] = dataclasses.field(default_factory=list)  # non-loopback requests that were blocked

    @property
    def endpoint(self) -> str:
        return self.hub.endpoint

    @property
    def cache_dir(self) -> Path:
        """Default ``huggingface_hub`` cache used by the patched client (``HF_HUB_CACHE``)."""
        return self.hf_home / "hub"

    def subprocess_env(self, *, offline: bool = False, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a child Python process that must talk to this server (env is read at import)."""
        env = dict(os.environ if base is None else base)
        for name in (
            "HF_TOKEN",
            "HUGGING_FACE_HUB_TOKEN",
            "HUGGINGFACE_CO_STAGING",
            "HF_HUB_CACHE",
            "HUGGINGFACE_HUB_CACHE",
            "HF_TOKEN_PATH",
            "TRANSFORMERS_OFFLINE",
        ):
            env.pop(name, None)
        env.update(
            HF_ENDPOINT=self.endpoint,
            HF_HOME=str(self.hf_home),
            HF_HUB_OFFLINE="1" if offline else "0",
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            NO_PROXY="127.0.0.1,localhost",
            no_proxy="127.0.0.1,localhost",
        )
        return env

    # convenience pass-throughs
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "hub":
            raise AttributeError(name)
        return getattr(self.hub, name)


class LoopbackOnlyError(RuntimeError):
    """huggingface_hub tried to reach a host other than 127.0.0.1 during a test."""


@contextlib.contextmanager
def loopback_only_client() -> Iterator[list[str]]:
    """Make the shared ``huggingface_hub`` HTTP client refuse any request whose host is not 127.0.0.1.

    Safety net on top of :func:`patch_hub_constants`: a constant the client reads that we did not patch would
    otherwise silently reach huggingface.co. Yields the list of refused URLs. Uses the public
    ``huggingface_hub.set_client_factory``, wrapping the default factory (its offline-mode hook is kept).
    """
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    refused: list[str] = []

    def guard(request: Any) -> None:
        if request.url.host != "127.0.0.1":
            refused.append(str(request.url))
            raise LoopbackOnlyError(f"Test tried to reach {request.url}; only the local hub (127.0.0.1) is allowed.")

    previous = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)

    def factory() -> Any:
        client = previous()
        hooks = client.event_hooks
        client.event_hooks = {"request": [*hooks.get("request", []), guard], "response": hooks.get("response", [])}
        return client

    set_client_factory(factory)  # also closes the current shared client
    try:
        yield refused
    finally:
        set_client_factory(previous)  # closes our client: no keep-alive connection outlives the server


@pytest.fixture
def hub_server(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubFixture]:
    """A running :class:`LocalHub` with ``huggingface_hub`` pointed at it and an isolated HF_HOME.

    Function-scoped: each test gets an empty hub and an empty cache; the server is stopped at teardown.
    While it is active, the shared huggingface_hub client refuses any host but 127.0.0.1
    (:func:`loopback_only_client`), and the test fails at teardown if such a request was attempted.
    """
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    hf_home = tmp_path_factory.mktemp("hf_home")
    with LocalHub() as hub, patch_hub_constants(hub.endpoint, hf_home), loopback_only_client() as refused:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # for code that reads the env directly
        fixture = HubFixture(hub=hub, hf_home=hf_home, refused_urls=refused)
        yield fixture
        assert not fixture.refused_urls, f"huggingface_hub tried to leave the loopback hub: {fixture.refused_urls}"
