"""Focus adapters loaded from a (loopback) Hub through the standard PEFT / transformers paths.

`model.load_adapter("org/name")`, `PeftModel.from_pretrained(base, "org/name", revision=...)` and the offline
cache give the pushed adapter's logits bit for bit; a corrupt download is refused before injection, with the
model left exactly as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hub_server import hub_server  # noqa: F401  (pytest fixture)
from huggingface_hub import CommitOperationAdd, HfApi
from peft import PeftModel
from tiny_models import assert_unmodified, ids, make_adapter, snapshot, tiny_model

from focus_hf.cli import main as cli_main
from focus_hf.files import AdapterFileError
from focus_hf.hub import push_adapter

REPO = "focus-test/tiny-llama-focus"
REPO_ROOT = Path(__file__).resolve().parents[2]


def logits_of(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids()).logits


@pytest.fixture
def pushed(hub_server, tmp_path):
    logits = make_adapter(tmp_path / "adapter")
    commit = push_adapter(tmp_path / "adapter", REPO)
    return tmp_path / "adapter", logits, commit


def test_transformers_load_adapter_from_hub(pushed):
    # transformers 5.x takes the Hub revision in adapter_kwargs: load_adapter(..., revision=...) is a TypeError.
    _, logits, commit = pushed
    model = tiny_model("llama")
    model.load_adapter(REPO)
    assert torch.equal(logits_of(model), logits)
    model = tiny_model("llama")
    model.load_adapter(REPO, adapter_kwargs={"revision": commit.oid})
    assert torch.equal(logits_of(model), logits)


def test_peft_from_pretrained_from_hub_branch(hub_server, tmp_path):
    logits = make_adapter(tmp_path / "adapter")
    commit = push_adapter(tmp_path / "adapter", REPO, revision="dev")
    for revision in ("dev", commit.oid):
        model = PeftModel.from_pretrained(tiny_model("llama"), REPO, revision=revision)
        assert torch.equal(logits_of(model), logits)
    model = tiny_model("llama")
    model.load_adapter(REPO, adapter_kwargs={"revision": "dev"})
    assert torch.equal(logits_of(model), logits)
    # A second adapter added to a PeftModel goes through PeftModel.load_adapter.
    other = make_adapter(tmp_path / "other", seed=1)
    push_adapter(tmp_path / "other", "focus-test/other")
    model = PeftModel.from_pretrained(tiny_model("llama"), REPO, revision="dev")
    model.load_adapter("focus-test/other", adapter_name="other")
    model.set_adapter("other")
    assert torch.equal(logits_of(model), other)


def test_repush_keeps_old_revision_loadable(pushed, tmp_path, hub_server):
    _, old_logits, first = pushed
    new_logits = make_adapter(tmp_path / "v2", seed=7)
    second = push_adapter(tmp_path / "v2", REPO, commit_message="Retrain")
    assert second.oid != first.oid and hub_server.head(REPO) == second.oid
    assert not torch.equal(old_logits, new_logits)

    model = tiny_model("llama")
    model.load_adapter(REPO)
    assert torch.equal(logits_of(model), new_logits)
    model = tiny_model("llama")
    model.load_adapter(REPO, adapter_kwargs={"revision": first.oid})
    assert torch.equal(logits_of(model), old_logits)
    model = PeftModel.from_pretrained(tiny_model("llama"), REPO, revision=first.oid)
    assert torch.equal(logits_of(model), old_logits)


_OFFLINE_CHILD = textwrap.dedent(
    """
    import sys, torch
    from huggingface_hub import constants
    assert constants.HF_HUB_OFFLINE
    sys.path.insert(0, sys.argv[1])
    import focus_hf
    from peft import PeftModel
    from tiny_models import tiny_model
    repo, ids, out = sys.argv[2], torch.load(sys.argv[3]), {}
    with torch.no_grad():
        for revision in sys.argv[5:]:
            model = tiny_model("llama")
            model.load_adapter(repo, adapter_kwargs={"revision": revision or None})
            out["transformers", revision] = model.eval()(input_ids=ids).logits
            model = PeftModel.from_pretrained(tiny_model("llama"), repo, revision=revision or None).eval()
            out["peft", revision] = model(input_ids=ids).logits
    torch.save(out, sys.argv[4])
    """
)


def test_offline_load_from_cache(pushed, hub_server, tmp_path):
    _, logits, first = pushed
    # Online once, into the fixture's HF_HOME cache (the child process uses the same one).
    tiny_model("llama").load_adapter(REPO)
    PeftModel.from_pretrained(tiny_model("llama"), REPO, revision=first.oid)
    make_adapter(tmp_path / "v2", seed=3)
    push_adapter(tmp_path / "v2", REPO)  # the Hub moves on; the cache still has the first commit
    n_requests = len(hub_server.requests)
    torch.save(ids(), tmp_path / "ids.pt")

    env = hub_server.subprocess_env(offline=True)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "out.pt"
    child = subprocess.run(
        [sys.executable, "-c", _OFFLINE_CHILD, str(REPO_ROOT / "tests" / "support"), REPO, str(tmp_path / "ids.pt"),
         str(out), "", first.oid],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    result = torch.load(out)
    assert len(result) == 4 and all(torch.equal(value, logits) for value in result.values())
    assert len(hub_server.requests) == n_requests  # offline: not a single request


@pytest.mark.parametrize("mode", ["tamper", "truncate", "short_read"])
@pytest.mark.parametrize("path", ["peft", "transformers"])
def test_corrupt_remote_weights_are_refused_before_injection(pushed, hub_server, mode, path):
    _, logits, _ = pushed
    hub_server.corrupt_file(REPO, "adapter_model.safetensors", mode)
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(AdapterFileError, match="adapter_model.safetensors .*(corrupt|incomplete)"):
        if path == "peft":
            PeftModel.from_pretrained(model, REPO)
        else:
            model.load_adapter(REPO)
    assert_unmodified(model, before)

    hub_server.clear_faults()  # the bad file was evicted from the cache: a retry downloads it afresh
    model = tiny_model("llama")
    model.load_adapter(REPO)
    assert torch.equal(logits_of(model), logits)


@pytest.mark.parametrize("path", ["peft", "transformers"])
def test_tampered_config_is_refused_before_injection(pushed, hub_server, path):
    folder, logits, _ = pushed
    real = (folder / "adapter_config.json").read_bytes()
    tampered = real.replace(b"\"window\": 8", b"\"window\": 9")  # valid JSON of the same length: a checksum tells
    assert tampered != real and len(tampered) == len(real)
    hub_server.corrupt_file(REPO, "adapter_config.json", "replace", tampered)
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(AdapterFileError, match="adapter_config.json of the Hub adapter .* tampered"):
        if path == "peft":
            PeftModel.from_pretrained(model, REPO)
        else:
            model.load_adapter(REPO)
    assert_unmodified(model, before)
    hub_server.clear_faults()
    model = tiny_model("llama")
    model.load_adapter(REPO)
    assert torch.equal(logits_of(model), logits)


def test_corrupt_cached_weights_are_refused_offline(pushed, hub_server):
    tiny_model("llama").load_adapter(REPO)
    cached = next(hub_server.cache_dir.rglob("adapter_model.safetensors")).resolve()
    data = bytearray(cached.read_bytes())
    data[-1] ^= 0xFF
    cached.write_bytes(bytes(data))
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(AdapterFileError, match="git-sha1"):
        model.load_adapter(
            REPO, adapter_kwargs={"local_files_only": True}
        )  # local_files_only=True: TypeError in transformers 5.23
    assert_unmodified(model, before)


def test_pickle_only_hub_adapter_is_refused(pushed, hub_server):
    folder, _, _ = pushed
    api = HfApi()
    api.create_repo("focus-test/pickled")
    api.create_commit("focus-test/pickled", [
        CommitOperationAdd("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
        CommitOperationAdd("adapter_model.bin", b"\x80\x04 pickle"),
    ], commit_message="pickle")  # fmt: skip
    for path in ("peft", "transformers"):
        model = tiny_model("llama")
        before = snapshot(model)
        with pytest.raises(AdapterFileError, match="refuses pickle"):
            if path == "peft":
                PeftModel.from_pretrained(model, "focus-test/pickled")
            else:
                model.load_adapter("focus-test/pickled")
        assert_unmodified(model, before)
    assert not [r for r in hub_server.requests if r.path.endswith("adapter_model.bin") and r.method == "GET"]


def _hostile_hub_repo(folder, tmp_path, repo, nan_in_safetensors=False):
    """Push `folder`'s adapter to `repo` with a NaN `adapter_model.bin` beside its safetensors (uploaded through the
    raw API: `push_adapter` refuses pickles), its config naming a local base saved as a pickle and as safetensors."""
    import io

    from safetensors.torch import load_file, save

    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    torch.save(base.state_dict(), tmp_path / "base" / "pytorch_model.bin")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "base")
    tensors = load_file(folder / "adapter_model.safetensors")
    pickled = io.BytesIO()
    torch.save({key: torch.full_like(value, float("nan")) for key, value in tensors.items()}, pickled)
    if nan_in_safetensors:
        next(iter(tensors.values()))[0, 0] = float("nan")
    api = HfApi()
    api.create_repo(repo)
    api.create_commit(repo, [
        CommitOperationAdd("adapter_config.json", json.dumps(config).encode()),
        CommitOperationAdd("adapter_model.safetensors", save(tensors)),
        CommitOperationAdd("adapter_model.bin", pickled.getvalue()),
    ], commit_message="hostile pickle beside the safetensors")  # fmt: skip


def test_hub_adapter_with_a_pickle_beside_loads_the_safetensors(pushed, hub_server, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    folder, logits, _ = pushed
    _hostile_hub_repo(folder, tmp_path, "focus-test/hostile")
    model = AutoModelForCausalLM.from_pretrained("focus-test/hostile", use_safetensors=False)  # the base: a pickle
    assert torch.equal(logits_of(model), logits)

    def forbidden(*args, **kwargs):
        raise AssertionError(f"torch.load called on {args[:1]}")

    monkeypatch.setattr(torch, "load", forbidden)
    model = PeftModel.from_pretrained(tiny_model("llama"), "focus-test/hostile")
    assert torch.equal(logits_of(model), logits)
    for use_safetensors in (None, False):
        model = tiny_model("llama")
        kwargs = {} if use_safetensors is None else {"use_safetensors": use_safetensors}
        model.load_adapter("focus-test/hostile", **kwargs)
        assert torch.equal(logits_of(model), logits)


def test_hub_adapter_with_nan_routers_is_refused(pushed, hub_server, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, _, _ = pushed
    _hostile_hub_repo(folder, tmp_path, "focus-test/nan", nan_in_safetensors=True)
    for path in ("peft", "transformers", "transformers-bin"):
        model = tiny_model("llama")
        before = snapshot(model)
        with pytest.raises(AdapterFileError, match="NaN"):
            if path == "peft":
                PeftModel.from_pretrained(model, "focus-test/nan")
            else:
                model.load_adapter("focus-test/nan", use_safetensors=path == "transformers")
        assert_unmodified(model, before)
    with pytest.raises(AdapterFileError, match="NaN"):
        AutoModelForCausalLM.from_pretrained("focus-test/nan")


# --- command line -------------------------------------------------------------------------------


def test_cli_push_and_pull(hub_server, tmp_path, capsys, monkeypatch):
    make_adapter(tmp_path / "adapter")
    assert cli_main(["push", str(tmp_path / "adapter"), REPO, "--revision", "exp", "--commit-message", "First"]) == 0
    head = hub_server.branches(REPO)["exp"]
    assert f'PeftModel.from_pretrained(base_model, "{REPO}", revision="{head}")' in capsys.readouterr().out
    assert cli_main(["pull", REPO, "--revision", "exp", "--local-dir", str(tmp_path / "pulled")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "pulled")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "pulled" / name).read_bytes() == (tmp_path / "adapter" / name).read_bytes()

    monkeypatch.setenv("HF_TOKEN", "hf_local")  # the commands use huggingface_hub's token (env or saved login)
    assert cli_main(["push", str(tmp_path / "adapter"), "focus-test/private", "--private"]) == 0
    assert hub_server.is_private("focus-test/private")
    assert cli_main(["push", str(tmp_path / "adapter"), "focus-test/public", "--public"]) == 0
    assert not hub_server.is_private("focus-test/public")
    payloads = {p["name"]: p.get("visibility") for p in hub_server.create_repo_payloads}
    assert payloads["private"] == "private" and payloads["public"] == "public"
    assert cli_main(["pull", REPO]) == 1  # main has no adapter
    assert "no adapter_config.json" in capsys.readouterr().err
    assert cli_main(["push", str(tmp_path / "missing"), REPO]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["pull", "not a repo"]) == 1
    assert json.loads((tmp_path / "pulled" / "adapter_config.json").read_text())["peft_type"] == "FOCUS"


def test_subfolder_adapter_is_checked_too(hub_server, tmp_path):
    logits = make_adapter(tmp_path / "adapter")
    api = HfApi()
    api.create_repo(REPO)
    api.create_commit(REPO, [CommitOperationAdd(f"focus/{name}", (tmp_path / "adapter" / name).read_bytes())
                             for name in ("adapter_config.json", "adapter_model.safetensors")],
                      commit_message="adapter in a subfolder")  # fmt: skip
    model = PeftModel.from_pretrained(tiny_model("llama"), REPO, subfolder="focus")
    assert torch.equal(logits_of(model), logits)
    model = tiny_model("llama")
    model.load_adapter(REPO, adapter_kwargs={"subfolder": "focus"})
    assert torch.equal(logits_of(model), logits)

    hub_server.corrupt_file(REPO, "focus/adapter_model.safetensors", "tamper")
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(AdapterFileError, match="subfolder 'focus'.*git-sha1"):
        model.load_adapter(REPO, adapter_kwargs={"subfolder": "focus", "force_download": True})
    assert_unmodified(model, before)
