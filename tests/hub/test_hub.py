"""End-to-end tests of focus_hf.hub against the real huggingface_hub client and a loopback Hub
(tests/support/hub_server.py).

No network beyond 127.0.0.1: the `hub_server` fixture points huggingface_hub at the local server and isolates
HF_HOME; the adapters here are hand-made folders (a FOCUS config + a small safetensors file), independent of the
focus_hf core.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hub_adapters import REPO, fake_adapter_folder, folder_state
from hub_server import LoopbackOnlyError, hub_server  # noqa: F401  (hub_server: pytest fixture)
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

from focus_hf.hub import (
    AdapterFolderError,
    AdapterIntegrityError,
    HubPushError,
    InvalidRepoIdError,
    NotAFocusAdapterError,
    pull_adapter,
    push_adapter,
    validate_repo_id,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
ADAPTER_FILES = ["README.md", "adapter_config.json", "adapter_model.safetensors", "attention_map.html",
                 "heads.png", "routing_stats.json"]  # fmt: skip


def child_env() -> dict[str, str]:
    """os.environ with the repository root on PYTHONPATH, so that a child process imports this focus_hf."""
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def assert_same_files(pulled: Path, source: Path, names=ADAPTER_FILES) -> None:
    """`pulled` holds exactly the files `names` of `source` (and, pulled into a folder, the pull's hidden record)."""
    assert sorted(p.name for p in pulled.iterdir() if p.is_file() and not p.name.startswith(".")) == sorted(names)
    for name in names:
        assert (pulled / name).read_bytes() == (source / name).read_bytes(), name


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    return fake_adapter_folder(tmp_path / "adapter")


# --- repo ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize("repo_id", ["org/name", "User_1/my-focus.adapter", "a/b", "Qwen/Qwen3-0.6B-focus"])
def test_valid_repo_ids(repo_id):
    assert validate_repo_id(repo_id) == repo_id


@pytest.mark.parametrize(
    "repo_id",
    [
        "", "name-only", "a/b/c", "/abs/path", "./org/name", "../org/name", "org/..", "org/../x", "~/adapter",
        "C:\\adapters\\x", "org\\name", "https://huggingface.co/org/name", "org/na me", " org/name", "org/name\n",
        "org/-name", "org/name.", "org/na--me", "org/na..me", "org/name.git", "org/námé", "org/", "/name",
        "org/" + "x" * 97,
    ],
)  # fmt: skip
def test_invalid_repo_ids_are_rejected(repo_id):
    with pytest.raises(InvalidRepoIdError):
        validate_repo_id(repo_id)


def test_path_objects_and_non_strings_are_rejected(tmp_path):
    with pytest.raises(InvalidRepoIdError, match="path"):
        validate_repo_id(tmp_path)
    with pytest.raises(InvalidRepoIdError):
        validate_repo_id(None)  # type: ignore[arg-type]


def test_bad_repo_ids_never_reach_the_hub(hub_server, adapter):
    for bad in ("../escape/x", str(adapter), "a/b/c"):
        with pytest.raises(InvalidRepoIdError):
            push_adapter(adapter, bad)
        with pytest.raises(InvalidRepoIdError):
            pull_adapter(bad)
    assert hub_server.requests == []


# --- the local Hub itself ---------------------------------------------------------------------


def test_local_hub_speaks_the_hub_protocol(hub_server, adapter, tmp_path):
    """The plain huggingface_hub client API works against the test server (for other tests to rely on)."""
    import threading

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RevisionNotFoundError

    api = HfApi()
    assert api.endpoint == hub_server.endpoint
    first = push_adapter(adapter, REPO)
    api.create_branch(REPO, branch="dev", revision=first.oid)
    api.create_branch(REPO, branch="dev", exist_ok=True)
    second = api.create_commit(REPO, [CommitOperationAdd("extra/notes.json", b"{}")], commit_message="more")

    info = api.model_info(REPO, revision=first.oid, files_metadata=True)
    assert info.sha == first.oid and info.id == REPO
    assert {s.rfilename: s.size for s in info.siblings}["adapter_config.json"] == (
        adapter / "adapter_config.json"
    ).stat().st_size
    assert api.model_info(REPO).sha == second.oid
    assert api.list_repo_files(REPO, revision="dev") == sorted([".gitattributes", *ADAPTER_FILES])
    assert "extra/notes.json" in api.list_repo_files(REPO)
    assert [e.path for e in api.list_repo_tree(REPO)] == sorted([".gitattributes", *ADAPTER_FILES, "extra"])
    assert {b.name: b.target_commit for b in api.list_repo_refs(REPO).branches} == {
        "main": second.oid,
        "dev": first.oid,
    }
    path = hf_hub_download(REPO, "heads.png", revision=first.oid[:12], cache_dir=tmp_path / "c")
    assert Path(path).read_bytes() == (adapter / "heads.png").read_bytes()
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="no-such-branch")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("focus-test/missing")
    assert api.repo_exists(REPO) and not api.repo_exists("focus-test/missing")
    assert threading.active_count() < 50  # handler threads do not pile up

    # Safety net: any host other than 127.0.0.1 is refused before a connection is made.
    with pytest.raises(LoopbackOnlyError):
        HfApi(endpoint="http://localhost:1").model_info(REPO)
    assert hub_server.refused_urls == [f"http://localhost:1/api/models/{REPO}"]
    hub_server.refused_urls.clear()  # otherwise the fixture fails the test at teardown


# --- push -> pull round trips -------------------------------------------------------------------


def test_push_then_pull_round_trip(hub_server, adapter, tmp_path):
    commit = push_adapter(adapter, REPO, token="hf_local")

    assert len(commit.oid) == 40 and commit.oid == hub_server.head(REPO)
    assert commit == f"{hub_server.endpoint}/{REPO}/commit/{commit.oid}"
    assert hub_server.commit_count(REPO) == 2  # the repo's initial commit + ours: one commit for all files
    assert hub_server.list_files(REPO) == sorted([".gitattributes", *ADAPTER_FILES])  # notes.txt skipped
    assert all(r.authorized for r in hub_server.requests)  # the token was sent with every request

    trees_listed = len(hub_server.requests_to("tree"))
    pulled = pull_adapter(REPO, cache_dir=tmp_path / "fresh-cache")
    assert pulled.parent.name == "snapshots" and pulled.name == commit.oid
    assert_same_files(pulled, adapter)
    # The checksums come from the Hub's listing of the commit (HfApi.verify_repo_checksums), fetched once more after
    # the download's own listing: no private cache file of huggingface_hub is read.
    assert len(hub_server.requests_to("tree")) == trees_listed + 2
    assert all(r.route is not None and r.status < 400 for r in hub_server.requests)  # no unknown/failed calls

    out = pull_adapter(REPO, cache_dir=tmp_path / "fresh-cache", local_dir=tmp_path / "out")
    assert out == tmp_path / "out"
    assert_same_files(out, adapter)
    assert not any(p.is_symlink() for p in out.iterdir())


def test_repush_creates_new_commit_and_old_revision_stays_pullable(hub_server, tmp_path):
    v1 = fake_adapter_folder(tmp_path / "v1", seed=1)
    v2 = fake_adapter_folder(tmp_path / "v2", seed=2)
    first = push_adapter(v1, REPO)
    second = push_adapter(v2, REPO, commit_message="Retrain")
    assert second.oid != first.oid and hub_server.head(REPO) == second.oid

    cache = tmp_path / "cache"
    assert (pull_adapter(REPO, cache_dir=cache) / "adapter_model.safetensors").read_bytes() == (
        v2 / "adapter_model.safetensors"
    ).read_bytes()
    old = pull_adapter(REPO, revision=first.oid, cache_dir=cache)
    assert old.name == first.oid
    assert_same_files(old, v1)

    # Nothing changed => no empty commit, the current head is returned.
    again = push_adapter(v2, REPO)
    assert again.oid == second.oid and hub_server.commit_count(REPO) == 3


def test_push_to_branch_and_pull_request(hub_server, adapter, tmp_path):
    commit = push_adapter(adapter, REPO, revision="experiment/v1")
    assert hub_server.branches(REPO)["experiment/v1"] == commit.oid
    assert "adapter_config.json" not in hub_server.list_files(REPO, "main")

    assert_same_files(pull_adapter(REPO, revision="experiment/v1", cache_dir=tmp_path / "c"), adapter)
    with pytest.raises(NotAFocusAdapterError, match="no adapter_config.json"):
        pull_adapter(REPO, cache_dir=tmp_path / "c")  # main only has .gitattributes

    pr = push_adapter(fake_adapter_folder(tmp_path / "v2", seed=5), REPO, create_pr=True)
    assert pr.pr_revision == "refs/pr/1" and pr.pr_url.endswith(f"{REPO}/discussions/1")
    assert "adapter_config.json" not in hub_server.list_files(REPO, "main")  # main untouched
    assert pull_adapter(REPO, revision="refs/pr/1", cache_dir=tmp_path / "c").name == pr.oid

    with pytest.raises(ValueError, match="branch name"):
        push_adapter(adapter, REPO, revision=commit.oid)


def test_private_repo_needs_a_token(hub_server, adapter, tmp_path):
    push_adapter(adapter, REPO, private=True, token="hf_local")
    assert hub_server.is_private(REPO)
    with pytest.raises(RepositoryNotFoundError):
        pull_adapter(REPO, cache_dir=tmp_path / "c1")
    assert_same_files(pull_adapter(REPO, token="hf_local", cache_dir=tmp_path / "c2"), adapter)


def test_a_new_repo_gets_the_namespaces_default_visibility(hub_server, adapter):
    """`private` is never sent as False: a repo pushed without --private / --public gets the Hub's default for its
    namespace, private for an organisation that asks for it."""
    hub_server.hub.private_namespaces.add("private-org")
    push_adapter(adapter, "private-org/adapter", token="hf_local")
    push_adapter(adapter, REPO, token="hf_local")
    assert hub_server.is_private("private-org/adapter") and not hub_server.is_private(REPO)
    assert all("visibility" not in payload and "private" not in payload for payload in hub_server.create_repo_payloads)
    push_adapter(adapter, "private-org/public", private=False, token="hf_local")
    assert not hub_server.is_private("private-org/public")


# --- offline ------------------------------------------------------------------------------------

_OFFLINE_CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    from huggingface_hub import constants
    assert constants.HF_HUB_OFFLINE and constants.ENDPOINT == sys.argv[1]  # env was read at import
    from focus_hf.hub import pull_adapter
    path = pull_adapter(sys.argv[2], revision=sys.argv[3] if len(sys.argv) > 3 else None)
    print(json.dumps({"path": str(path), "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                                   for p in path.iterdir()}}))
    """
)


def test_offline_pull_from_cache(hub_server, tmp_path):
    v1 = fake_adapter_folder(tmp_path / "v1", seed=1)
    first = push_adapter(v1, REPO)
    pull_adapter(REPO)  # online, into the fixture's HF_HOME cache (what the child process will use)
    pull_adapter(REPO, revision=first.oid)
    push_adapter(fake_adapter_folder(tmp_path / "v2", seed=2), REPO)  # the Hub moves on; the cache still has v1
    n_requests = len(hub_server.requests)

    child = subprocess.run(
        [sys.executable, "-c", _OFFLINE_CHILD, hub_server.endpoint, REPO],
        env=hub_server.subprocess_env(offline=True, base=child_env()),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert Path(result["path"]).name == first.oid  # "main" as last seen online
    assert result["files"] == {n: hashlib.sha256((v1 / n).read_bytes()).hexdigest() for n in ADAPTER_FILES}
    assert len(hub_server.requests) == n_requests  # offline: not a single request

    # In-process: local_files_only, and HF_HUB_OFFLINE patched in huggingface_hub.constants.
    assert_same_files(pull_adapter(REPO, revision=first.oid, local_files_only=True), v1)
    with pytest.MonkeyPatch.context() as patch:
        from huggingface_hub import constants

        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        assert pull_adapter(REPO).name == first.oid
        with pytest.raises(LocalEntryNotFoundError):
            pull_adapter(REPO, revision="never-downloaded")
    assert len(hub_server.requests) == n_requests

    # A cache corrupted on disk is caught offline too (checksums of the cached tree listing), and evicted.
    blob = (pull_adapter(REPO, revision=first.oid, local_files_only=True) / "adapter_model.safetensors").resolve()
    data = blob.read_bytes()
    blob.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(AdapterIntegrityError, match="git-sha1"):
        pull_adapter(REPO, revision=first.oid, local_files_only=True)
    with pytest.raises(LocalEntryNotFoundError, match="incomplete"):
        pull_adapter(REPO, revision=first.oid, local_files_only=True)
    assert len(hub_server.requests) == n_requests
    assert_same_files(pull_adapter(REPO, revision=first.oid), v1)  # online again: downloaded afresh


# --- faults -------------------------------------------------------------------------------------


def test_server_error_mid_push_is_clear_and_leaves_folder_untouched(hub_server, adapter):
    push_adapter(fake_adapter_folder(adapter.parent / "v0", seed=9), REPO)
    head = hub_server.head(REPO)
    before = folder_state(adapter)

    hub_server.fail_next_commit(status=500)
    expected = r"failed while committing: the Hub answered HTTP 500\. Nothing was committed.* The local folder was not"
    with pytest.raises(HubPushError, match=expected) as info:
        push_adapter(adapter, REPO)
    assert info.value.__cause__ is not None  # the huggingface_hub error is chained
    assert folder_state(adapter) == before
    assert hub_server.head(REPO) == head  # nothing committed
    assert len(hub_server.requests_to("preupload")) == 2  # the failure came after preupload, at commit time

    assert push_adapter(adapter, REPO).oid == hub_server.head(REPO) != head  # a retry goes through
    assert folder_state(adapter) == before


@pytest.mark.parametrize("mode", ["tamper", "truncate", "short_read"])
def test_corrupt_download_is_refused_and_evicted(hub_server, adapter, tmp_path, mode):
    push_adapter(adapter, REPO)
    hub_server.corrupt_file(REPO, "adapter_model.safetensors", mode)
    cache = tmp_path / "cache"
    with pytest.raises(AdapterIntegrityError, match="adapter_model.safetensors|Consistency check failed"):
        pull_adapter(REPO, cache_dir=cache, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-verified was copied out

    hub_server.clear_faults()  # the corrupt file was evicted from the cache, so a retry downloads it again
    assert_same_files(pull_adapter(REPO, cache_dir=cache), adapter)


def test_tampered_config_is_refused(hub_server, adapter, tmp_path):
    push_adapter(adapter, REPO)
    hub_server.corrupt_file(REPO, "adapter_config.json", "tamper")
    with pytest.raises(AdapterIntegrityError, match="adapter_config.json: git-sha1"):
        pull_adapter(REPO, cache_dir=tmp_path / "cache")


def _upload_raw(hub_server, files: dict[str, bytes]) -> None:
    """Create a repo with arbitrary content, bypassing push_adapter's checks."""
    api = HfApi()
    api.create_repo(REPO, exist_ok=True)
    api.create_commit(REPO, [CommitOperationAdd(k, v) for k, v in files.items()], commit_message="raw")


def test_repo_without_focus_config_is_refused(hub_server, tmp_path):
    lora = fake_adapter_folder(tmp_path / "lora", peft_type="LORA")
    weights = (lora / "adapter_model.safetensors").read_bytes()
    _upload_raw(hub_server, {"adapter_config.json": (lora / "adapter_config.json").read_bytes(),
                             "adapter_model.safetensors": weights})  # fmt: skip
    with pytest.raises(NotAFocusAdapterError, match="peft_type 'LORA'"):
        pull_adapter(REPO, cache_dir=tmp_path / "c1")

    _upload_raw(hub_server, {"adapter_config.json": b"[1, 2]"})
    with pytest.raises(NotAFocusAdapterError, match="not a JSON object"):
        pull_adapter(REPO, cache_dir=tmp_path / "c2")


def test_repo_without_config_or_with_pickles_is_refused(hub_server, adapter, tmp_path):
    _upload_raw(hub_server, {"adapter_model.safetensors": (adapter / "adapter_model.safetensors").read_bytes()})
    with pytest.raises(NotAFocusAdapterError, match="no adapter_config.json"):
        pull_adapter(REPO, cache_dir=tmp_path / "c1")

    _upload_raw(hub_server, {"adapter_config.json": (adapter / "adapter_config.json").read_bytes(),
                             "adapter_model.bin": b"\x80\x04 pickle"})  # fmt: skip
    with pytest.raises(NotAFocusAdapterError, match="pickle"):
        pull_adapter(REPO, cache_dir=tmp_path / "c2")
    assert not [r for r in hub_server.requests if r.path.endswith("adapter_model.bin")]  # never downloaded


# --- local folder checks (nothing is sent) --------------------------------------------------------


@pytest.mark.parametrize(
    "bad_file",
    ["adapter_model.bin", "optimizer.pt", "rng_state.pth", "data.pkl", "last.ckpt", "sub/training_args.bin",
     "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "base.gguf"],
)  # fmt: skip
def test_push_refuses_pickles_and_base_weights(hub_server, adapter, bad_file):
    (adapter / bad_file).parent.mkdir(parents=True, exist_ok=True)
    (adapter / bad_file).write_bytes(b"\x80\x04 not allowed")
    with pytest.raises(AdapterFolderError, match="pickle|base-model"):
        push_adapter(adapter, REPO)
    assert hub_server.requests == []


def test_push_skips_training_checkpoints(hub_server, adapter, caplog):
    # What `focus-hf train` leaves in <out>/checkpoints: Trainer checkpoints with pickled optimizer/RNG state.
    checkpoint = adapter / "checkpoints" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
        (checkpoint / name).write_bytes(b"\x80\x04 pickle")
    for name in ("adapter_model.safetensors", "adapter_config.json", "trainer_state.json"):
        (checkpoint / name).write_bytes((adapter / name).read_bytes() if (adapter / name).exists() else b"{}")
    before = folder_state(adapter)
    with caplog.at_level("WARNING", logger="focus_hf.hub"):
        push_adapter(adapter, REPO)
    assert hub_server.list_files(REPO) == sorted([".gitattributes", *ADAPTER_FILES])
    notes = [r.getMessage() for r in caplog.records if "checkpoints" in r.getMessage()]
    assert len(notes) == 1 and "not part of the adapter" in notes[0]
    assert folder_state(adapter) == before
    # Only the training folder is exempt: a pickle anywhere else is still refused.
    (adapter / "other").mkdir()
    (adapter / "other" / "optimizer.pt").write_bytes(b"\x80\x04 pickle")
    with pytest.raises(AdapterFolderError, match="pickle"):
        push_adapter(adapter, REPO)


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_push_refuses_incomplete_folder(hub_server, adapter, missing):
    (adapter / missing).unlink()
    with pytest.raises(AdapterFolderError, match=f"{missing} is missing"):
        push_adapter(adapter, REPO)
    with pytest.raises(AdapterFolderError, match="does not exist"):
        push_adapter(adapter / "nope", REPO)
    assert hub_server.requests == []


def test_push_refuses_non_focus_config_and_broken_weights(hub_server, tmp_path):
    with pytest.raises(AdapterFolderError, match="peft_type 'LORA'"):
        push_adapter(fake_adapter_folder(tmp_path / "lora", peft_type="LORA"), REPO)
    broken = fake_adapter_folder(tmp_path / "broken")
    data = (broken / "adapter_model.safetensors").read_bytes()
    (broken / "adapter_model.safetensors").write_bytes(data[:-10])
    with pytest.raises(AdapterFolderError, match="truncated or padded"):
        push_adapter(broken, REPO)
    assert hub_server.requests == []
