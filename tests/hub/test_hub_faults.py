"""Connections dropped in the middle of a transfer, through the loopback Hub (`LocalHub.drop_connection`).

A push cut mid-commit leaves the repo as it was, or complete in one commit when the commit landed and only its answer
was lost, and the error says which; a pull cut mid-download leaves no file a later load would trust (not in the cache's
snapshot, not in the pulled folder), and a retry completes it. (huggingface_hub retries a cut download a few times by
itself; it reads a body in chunks of 10 MB, so a file as small as these starts again from its first byte.)
"""

from __future__ import annotations

import pytest
import torch
from hub_adapters import REPO, fake_adapter_folder, folder_state
from hub_server import hub_server  # noqa: F401  (pytest fixture)
from huggingface_hub import constants
from peft import PeftModel
from tiny_models import assert_unmodified, ids, snapshot, tiny_model
from tiny_models import make_adapter as make_loadable_adapter

from focus_hf.files import AdapterFileError
from focus_hf.hub import AdapterIntegrityError, HubPushError, pull_adapter, push_adapter

WEIGHTS = "adapter_model.safetensors"


def test_push_cut_mid_upload_leaves_the_repo_as_it_was(hub_server, tmp_path):
    push_adapter(fake_adapter_folder(tmp_path / "v0", seed=0), REPO)
    head, commits = hub_server.head(REPO), hub_server.commit_count(REPO)
    folder = fake_adapter_folder(tmp_path / "v1", seed=1)
    before = folder_state(folder)
    hub_server.drop_connection("commit", after_bytes=200)  # part of the commit's body arrives, then nothing
    with pytest.raises(HubPushError, match=f"Nothing was committed: {REPO}@main is still at {head}") as refused:
        push_adapter(folder, REPO)
    assert "the connection broke" in str(refused.value)
    assert hub_server.head(REPO) == head and hub_server.commit_count(REPO) == commits
    assert folder_state(folder) == before
    retried = push_adapter(folder, REPO)  # a retry completes it, in one commit
    assert hub_server.head(REPO) == retried.oid and hub_server.commit_parent(REPO, retried.oid) == head
    assert hub_server.get_file(REPO, WEIGHTS) == (folder / WEIGHTS).read_bytes()


def test_push_whose_answer_is_lost_is_complete_in_one_commit_and_says_so(hub_server, tmp_path):
    push_adapter(fake_adapter_folder(tmp_path / "v0", seed=0), REPO)
    head = hub_server.head(REPO)
    folder = fake_adapter_folder(tmp_path / "v1", seed=1)
    hub_server.drop_connection("commit", after_apply=True)  # the commit lands; the connection drops before the answer
    with pytest.raises(HubPushError, match="The commit landed all the same") as refused:
        push_adapter(folder, REPO)
    landed = hub_server.head(REPO)
    assert landed != head and landed in str(refused.value) and hub_server.commit_parent(REPO, landed) == head
    for name in ("adapter_config.json", WEIGHTS, "README.md"):
        assert hub_server.get_file(REPO, name) == (folder / name).read_bytes()
    assert push_adapter(folder, REPO).oid == landed  # nothing left to push: no second commit


def test_pull_cut_mid_download_resumes_and_completes(hub_server, tmp_path):
    folder = fake_adapter_folder(tmp_path / "adapter")
    push_adapter(folder, REPO)
    hub_server.drop_connection("resolve", after_bytes=300, path=WEIGHTS)
    pulled = pull_adapter(REPO, local_dir=tmp_path / "out", cache_dir=tmp_path / "cache")
    assert (pulled / WEIGHTS).read_bytes() == (folder / WEIGHTS).read_bytes()
    gets = [r for r in hub_server.requests_to("resolve") if r.method == "GET" and r.path.endswith(WEIGHTS)]
    assert [r.status for r in gets] == [0, 200]  # cut after 300 bytes (status 0: no whole answer), then fetched


def test_pull_cut_for_good_leaves_no_file_a_load_trusts_and_a_retry_completes_it(hub_server, tmp_path, monkeypatch):
    folder = tmp_path / "adapter"
    logits = make_loadable_adapter(folder)
    push_adapter(folder, REPO)
    cache = tmp_path / "cache"
    # 300 bytes arrive, then every further try is cut before any byte: huggingface_hub gives up after its retries.
    hub_server.drop_connection("resolve", after_bytes=300, path=WEIGHTS)
    hub_server.drop_connection("resolve", after_bytes=0, path=WEIGHTS, count=8)
    with pytest.raises(AdapterIntegrityError, match="did not complete .* retry the pull"):
        pull_adapter(REPO, local_dir=tmp_path / "out", cache_dir=cache)
    assert not (tmp_path / "out").exists()  # nothing copied
    assert not list(cache.rglob(f"snapshots/*/{WEIGHTS}"))  # no weights in the snapshot a load reads
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # a later load from that cache finds no weights
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(OSError):
        PeftModel.from_pretrained(model, REPO, cache_dir=str(cache))
    assert_unmodified(model, before)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    hub_server.clear_faults()
    pulled = pull_adapter(REPO, local_dir=tmp_path / "out", cache_dir=cache)  # the retry completes it
    assert (pulled / WEIGHTS).read_bytes() == (folder / WEIGHTS).read_bytes()
    statuses = [r.status for r in hub_server.requests_to("resolve") if r.method == "GET" and r.path.endswith(WEIGHTS)]
    assert statuses == [0] * 6 + [200]  # the first try and huggingface_hub's 5 retries cut, then the retry
    model = PeftModel.from_pretrained(tiny_model("llama"), REPO, cache_dir=str(cache)).eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids()).logits, logits)


def test_load_cut_mid_download_leaves_the_model_as_it_was_and_a_retry_loads_it(hub_server, tmp_path):
    logits = make_loadable_adapter(tmp_path / "adapter")
    push_adapter(tmp_path / "adapter", REPO)
    hub_server.drop_connection("resolve", after_bytes=0, path=WEIGHTS, count=6)
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(AdapterFileError, match=f"Download of {WEIGHTS} from {REPO}@main is incomplete"):
        model.load_adapter(REPO)
    assert_unmodified(model, before)
    model.load_adapter(REPO)  # the connection is back
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids()).logits, logits)
