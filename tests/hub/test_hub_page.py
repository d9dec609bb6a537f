"""The page a pushed Focus adapter gets on the (loopback) Hub.

The code of the Hub's "Use this model" button, written out from the pushed adapter_config.json as the Hub writes it
(`card_checks.hub_peft_snippet`), runs unchanged in a fresh interpreter of an environment where the package is
installed (in editable mode, as CI installs it) and that never imports focus_hf itself: the package's `.pth` file
registers Focus with PEFT when peft is imported. The same interpreter loads the adapter through transformers too, and
loads an adapter saved before task_type was recorded. The card opens with the same lines.
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
from card_checks import hub_peft_snippet, renderer
from hub_server import hub_server  # noqa: F401  (pytest fixture)
from huggingface_hub import HfApi, ModelCard, hf_hub_download
from peft import get_peft_model
from tiny_models import ids, tiny_model
from transformers import AutoModelForCausalLM

import focus_hf
from focus_hf.card import write_model_card
from focus_hf.hub import push_adapter

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = "focus-test/tiny-base"
REPO = "focus-test/tiny-base-focus"
OLD_REPO = "focus-test/saved-before-task-type"


@pytest.fixture(scope="module")
def installed_python(tmp_path_factory) -> Path:
    """The Python of a fresh virtual environment holding this checkout installed in editable mode (its other
    packages come from the running environment: nothing is downloaded)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(REPO_ROOT)]
    subprocess.run(install, check=True, env=env, cwd=venv, capture_output=True, timeout=600)
    return python


def push_base(tmp_path: Path) -> str:
    """A tiny base model on the Hub; returns its commit."""
    folder = tmp_path / "base"
    tiny_model("llama").save_pretrained(folder)
    api = HfApi()
    api.create_repo(BASE)
    return api.upload_folder(folder_path=folder, repo_id=BASE).oid


def save_adapter(model, folder: Path, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "focus_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator))
    model.eval().save_pretrained(folder)
    with torch.no_grad():
        return model(input_ids=ids()).logits


CHECKS = """
import sys, torch
# Nothing here imported focus_hf: the installed package did, once peft was imported, from this checkout.
assert sys.modules["focus_hf"].__file__.startswith({root!r}), sys.modules["focus_hf"].__file__
ids = torch.load({ids!r})
with torch.no_grad():
    out = {{"snippet": model.eval()(input_ids=ids).logits}}
    from transformers import AutoModelForCausalLM
    direct = AutoModelForCausalLM.from_pretrained({repo!r})  # the adapter's id in place of a model's
    out["auto"] = direct.eval()(input_ids=ids).logits
    old = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {old!r})
    out["old"] = old.eval()(input_ids=ids).logits
torch.save(out, {out!r})
"""


def test_the_hubs_own_snippet_loads_the_adapter_without_importing_focus_hf(
    hub_server, tmp_path, installed_python
):
    base_commit = push_base(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(BASE)
    model = get_peft_model(base, focus_hf.FocusConfig(num_groups=4, window=8))
    logits = save_adapter(model, tmp_path / "adapter", seed=1)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["revision"] == base_commit  # the base's commit recorded
    assert config["base_model_name_or_path"] == BASE
    write_model_card(tmp_path / "adapter", repo_id=REPO)
    push_adapter(tmp_path / "adapter", REPO)

    # What the Hub's page shows, built from the pushed config alone; the card opens with the same lines.
    pushed = json.loads(Path(hf_hub_download(REPO, "adapter_config.json")).read_text())
    snippet = hub_peft_snippet(REPO, pushed)
    assert snippet.startswith("from peft import PeftModel\nfrom transformers import AutoModelForCausalLM")
    card = ModelCard.load(hf_hub_download(REPO, "README.md"))
    assert [t.content.strip() for t in renderer().parse(card.text) if t.type == "fence"][1] == snippet

    old_model = get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8))
    old_logits = save_adapter(old_model, tmp_path / "old", seed=2)
    old_config = json.loads((tmp_path / "old" / "adapter_config.json").read_text())
    old_config["task_type"] = None  # as adapters were saved before task_type was recorded
    (tmp_path / "old" / "adapter_config.json").write_text(json.dumps(old_config))
    push_adapter(tmp_path / "old", OLD_REPO)
    assert hub_peft_snippet(OLD_REPO, old_config) == "Task type is invalid."

    torch.save(ids(), tmp_path / "ids.pt")
    script = snippet + "\n" + CHECKS.format(
        root=str(REPO_ROOT), ids=str(tmp_path / "ids.pt"), repo=REPO, base=BASE, old=OLD_REPO,
        out=str(tmp_path / "out.pt"),
    )  # fmt: skip
    assert "import focus_hf" not in script and "from focus_hf" not in script
    (tmp_path / "page.py").write_text(script)
    env = {key: value for key, value in hub_server.subprocess_env().items() if key != "PYTHONPATH"}
    child = subprocess.run([str(installed_python), str(tmp_path / "page.py")], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    out = torch.load(tmp_path / "out.pt")
    assert torch.equal(out["snippet"], logits) and torch.equal(out["auto"], logits)
    assert torch.equal(out["old"], old_logits)


def test_without_the_registration_peft_fails_as_before(hub_server, tmp_path, installed_python):
    """FOCUS_HF_AUTOLOAD=0 turns the registration off: the snippet then needs `import focus_hf` first."""
    push_adapter_folder = tmp_path / "adapter"
    save_adapter(get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8)),
                 push_adapter_folder, seed=3)  # fmt: skip
    push_adapter(push_adapter_folder, REPO)
    code = textwrap.dedent(
        f"""
        import sys
        from peft import PeftConfig
        assert "focus_hf" not in sys.modules
        try:
            PeftConfig.from_pretrained({REPO!r})
        except KeyError as error:
            print("KeyError", error)
        import focus_hf
        print(PeftConfig.from_pretrained({REPO!r}).peft_type)
        """
    )
    env = {key: value for key, value in hub_server.subprocess_env().items() if key != "PYTHONPATH"}
    child = subprocess.run([str(installed_python), "-c", code], env={**env, "FOCUS_HF_AUTOLOAD": "0"},
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    assert child.stdout.split("\n")[:2] == ["KeyError 'FOCUS'", "PeftType.FOCUS"]
