"""Run PEFT's and transformers' own adapter tests with Focus in place of LoRA, offline (the peer suites).

A checking tool, not part of the CI test command; ``scripts/peer_suites/README.md`` says how to run it and what
it does. Subcommands:

- ``transformers TEST_FILE --work DIR``: transformers' ``tests/peft_integration/test_peft_integration.py``
  (``TEST_FILE``, fetched by hand: transformers' source distribution ships no tests). Builds tiny random models,
  a tokenizer and Focus adapters at the Hub ids the file names, serves them from a loopback Hub
  (``tests/support/hub_server.py``) into a Hugging Face cache under ``DIR/hf_home``, then runs the substituted file with
  ``HF_HUB_OFFLINE=1`` and ``RUN_SLOW=1`` (the file is marked slow), and classifies the results.
- ``peft SDIST --work DIR``: ``tests/test_decoder_models.py``, ``tests/test_config.py`` and ``tests/test_auto.py``
  of PEFT's source distribution (``pip download peft==X --no-binary :all: --no-deps``). The tiny models and
  Focus adapters are saved as folders at the Hub ids the tests name, under ``DIR`` (the tests' working
  directory), and the suites run with ``HF_HUB_OFFLINE=1``.
- ``classify JUNIT_XML --suite transformers|peft``: the classification alone, of an earlier run.

Nothing here reaches a network other than 127.0.0.1.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# --------------------------------------------------------------------------------------------------- substitution
# Each `from peft import ...` line that imports one of focus_peer.SUBSTITUTED is followed by a line importing the
# same names from focus_peer (same indentation), so the test builds a FocusConfig where it built that config.
_PEFT_IMPORT = re.compile(r"^(?P<indent>\s*)from peft import (?P<names>[\w, ]+)$", re.MULTILINE)
SUBSTITUTED = ("LoraConfig", "LoKrConfig", "IA3Config")
SUBSTITUTION_MARK = "# peer-suite substitution: Focus in place of"


def substitute_imports(source: str) -> tuple[str, list[str]]:
    """Return the test source with the Focus imports added after each peft import of a substituted config."""
    changed: list[str] = []

    def add_focus(match: re.Match) -> str:
        names = [name.strip() for name in match["names"].split(",")]
        replaced = [name for name in names if name in SUBSTITUTED]
        if not replaced:
            return match[0]
        changed.append(match[0].strip())
        names = ", ".join(replaced)
        line = f"{match['indent']}from focus_peer import {names}  {SUBSTITUTION_MARK} {'/'.join(replaced)}"
        return f"{match[0]}\n{line}"

    return _PEFT_IMPORT.sub(add_focus, source), changed


FOCUS_DECODER_CONFIGS = '''ALL_CONFIGS = [
    (
        FocusConfig,
        {
            "task_type": "CAUSAL_LM",
            "num_groups": 2,
            "window": 0,
            "sink_tokens": 0,
            "top_k": 1,
        },
    ),
]'''


def substitute_peft_suites(tests: Path) -> None:
    """PEFT's suites: the config lists of test_decoder_models.py and test_config.py become Focus's alone."""
    header = "import focus_hf  # noqa: F401\nfrom focus_hf import FocusConfig\n"
    path = tests / "test_decoder_models.py"
    source = path.read_text()
    start = source.index("ALL_CONFIGS = [")
    end = source.index("\n\n\ndef _skip_if_not_conv1d_supported")
    path.write_text(header + source[:start] + FOCUS_DECODER_CONFIGS + source[end:])

    path = tests / "test_config.py"
    source = path.read_text()
    start = source.index("ALL_CONFIG_CLASSES = (")
    end = source.index("\n)\n", start) + 3
    path.write_text(header + source[:start] + "ALL_CONFIG_CLASSES = (\n    (FocusConfig, {}),\n)\n" + source[end:])


# --------------------------------------------------------------------------------------------------- tiny models
TINY = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 128, "vocab": 1000}


def tiny_opt_config(**extra: Any):
    from transformers import OPTConfig

    return OPTConfig(
        hidden_size=TINY["hidden"], num_hidden_layers=TINY["layers"], ffn_dim=TINY["ffn"],
        num_attention_heads=TINY["heads"], word_embed_proj_dim=TINY["hidden"], vocab_size=TINY["vocab"], **extra,
    )


def build_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer of 1,000 tokens trained on the standard library's docstrings (OPT's layout:
    <s> 0, <pad> 1, </s> 2, <unk> 3), standing in for the tiny test repos' GPT-2 tokenizer."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY["vocab"], special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator([os.__doc__, *pydoc_data.topics.topics.values()], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="</s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)


def save_focus_adapter(base, folder: Path, base_id: str, task_type: str | None = None) -> dict:
    """A Focus adapter (random routers, the peer options) for ``base``, saved at ``folder``; returns its tensors."""
    import torch
    from peft import get_peft_model
    from safetensors.torch import load_file

    sys.path.insert(0, str(HERE))
    from focus_peer import PEER_OPTIONS

    from focus_hf import FocusConfig

    torch.manual_seed(1)
    config = FocusConfig(**PEER_OPTIONS, init_weights=False, task_type=task_type, base_model_name_or_path=base_id)
    model = get_peft_model(base, config)
    model.peft_config["default"].base_model_name_or_path = base_id
    model.save_pretrained(folder)
    model.unload()
    return load_file(folder / "adapter_model.safetensors")


def build_transformers_repos(stage: Path) -> dict[str, dict[str, Path]]:
    """The repos transformers' test file downloads, as folders per (repo id, revision)."""
    import torch
    from transformers import OPTForCausalLM

    base_id = "hf-internal-testing/tiny-random-OPTForCausalLM"
    adapter_id = "peft-internal-testing/tiny-OPTForCausalLM-lora"
    revision_id = "peft-internal-testing/tiny-opt-lora-revision"
    repos: dict[str, dict[str, Path]] = {}

    base_dir = stage / "base"
    torch.manual_seed(0)
    # learned positions for the Trainer test's 128-token rows (OPT adds an offset of 2)
    config = tiny_opt_config(max_position_embeddings=256, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    base = OPTForCausalLM(config)
    base.save_pretrained(base_dir)
    # the tiny test repos also hold pytorch_model.bin, which use_safetensors=False asks for (a base model's pickle)
    torch.save(base.state_dict(), base_dir / "pytorch_model.bin")
    build_tokenizer(base_dir)
    # transformers passes an adapter's revision on to its base model: the base repo has the same refs/pr/2
    repos[base_id] = {"main": base_dir, "refs/pr/2": base_dir}

    # The LoRA repo holds adapter_model.bin (main) and adapter_model.safetensors (refs/pr/2). A Focus adapter is
    # always safetensors; the .bin beside it (the same tensors) is what the tests read with torch.load themselves.
    adapter_dir = stage / "adapter"
    tensors = save_focus_adapter(OPTForCausalLM.from_pretrained(base_dir), adapter_dir, base_id, "CAUSAL_LM")
    torch.save(tensors, adapter_dir / "adapter_model.bin")
    repos[adapter_id] = {"main": adapter_dir, "refs/pr/2": adapter_dir}

    # main: the adapter in test_subfolder/ only; branch "test": the adapter at the root.
    main_dir, test_dir = stage / "revision-main", stage / "revision-test"
    save_focus_adapter(OPTForCausalLM.from_pretrained(base_dir), main_dir / "test_subfolder", base_id, "CAUSAL_LM")
    save_focus_adapter(OPTForCausalLM.from_pretrained(base_dir), test_dir, base_id, "CAUSAL_LM")
    repos[revision_id] = {"main": main_dir, "test": test_dir}
    return repos


def fill_hub_cache(repos: dict[str, dict[str, Path]], hf_home: Path) -> None:
    """Upload each folder to a loopback Hub (tests/support/hub_server.py) and download every revision into the cache."""
    sys.path.insert(0, str(REPO / "tests" / "support"))
    from hub_server import LocalHub, loopback_only_client, patch_hub_constants

    with LocalHub() as hub, patch_hub_constants(hub.endpoint, hf_home), loopback_only_client():
        from huggingface_hub import HfApi, snapshot_download

        api = HfApi(endpoint=hub.endpoint, token="local")
        for repo_id, revisions in repos.items():
            api.create_repo(repo_id, exist_ok=True)
            api.upload_folder(repo_id=repo_id, folder_path=revisions["main"], commit_message="main")
            for revision, folder in revisions.items():
                if revision == "main":
                    continue
                if folder == revisions["main"]:  # the same commit under another ref (refs/pr/2)
                    hub._repos[repo_id].branches[revision] = hub.head(repo_id)
                    continue
                api.create_branch(repo_id, branch=revision, revision=hub._repos[repo_id].commits[
                    hub.head(repo_id)].parent)
                api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision, commit_message=revision)
            for revision in revisions:
                snapshot_download(repo_id, revision=revision, cache_dir=hf_home / "hub")


def build_peft_folders(work: Path) -> None:
    """Tiny random models (and Focus adapters at test_auto.py's LoRA adapter ids) as folders under ``work``."""
    import torch
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForQuestionAnswering,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        Gemma3TextConfig,
        GPT2Config,
        GPTJConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        T5Config,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )

    special = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common = dict(vocab_size=TINY["vocab"], **special)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, **common)
    gpt2 = dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)
    bases = {
        "peft-internal-testing/tiny-random-OPTForCausalLM": tiny_opt_config(max_position_embeddings=128, **special),
        "peft-internal-testing/tiny-random-GPT2LMHeadModel": GPT2Config(**gpt2, **common),
        "hf-internal-testing/tiny-random-gpt2": GPT2Config(**gpt2, **common),
        "peft-internal-testing/tiny-random-GPTJForCausalLM": GPTJConfig(
            n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=128, **common),
        "trl-internal-testing/tiny-random-LlamaForCausalLM": LlamaConfig(**small),
        "peft-internal-testing/tiny-dummy-qwen2": Qwen2Config(**small),
        "hf-internal-testing/tiny-random-Gemma3ForCausalLM": Gemma3TextConfig(**small, head_dim=16, sliding_window=64),
        "hf-internal-testing/tiny-random-MistralForCausalLM": MistralConfig(**small),
    }
    for name, config in bases.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(work / name)

    def opt():
        return tiny_opt_config(max_position_embeddings=128, pad_token_id=1)

    def t5():
        return T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=1000,
                        decoder_start_token_id=0)

    def whisper():
        return WhisperConfig(
            d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=51866, pad_token_id=50256, bos_token_id=50257,
            eos_token_id=50257, decoder_start_token_id=50258, num_mel_bins=16, max_source_positions=32,
            max_target_positions=64)

    adapters = {
        "peft-internal-testing/tiny-OPTForCausalLM-lora": (AutoModelForCausalLM, opt, "CAUSAL_LM"),
        "peft-internal-testing/tiny-random-OPTForCausalLM-extended-vocab": (AutoModelForCausalLM, opt, "CAUSAL_LM"),
        "peft-internal-testing/tiny_T5ForSeq2SeqLM-lora": (AutoModelForSeq2SeqLM, t5, "SEQ_2_SEQ_LM"),
        "peft-internal-testing/tiny_OPTForSequenceClassification-lora": (
            AutoModelForSequenceClassification, opt, "SEQ_CLS"),
        "peft-internal-testing/tiny_GPT2ForTokenClassification-lora": (
            AutoModelForTokenClassification, lambda: GPT2Config(**gpt2, vocab_size=1000), "TOKEN_CLS"),
        "peft-internal-testing/tiny_OPTForQuestionAnswering-lora": (AutoModelForQuestionAnswering, opt, "QUESTION_ANS"),
        "peft-internal-testing/tiny_OPTForFeatureExtraction-lora": (AutoModel, opt, "FEATURE_EXTRACTION"),
        "peft-internal-testing/tiny_WhisperForConditionalGeneration-lora": (
            WhisperForConditionalGeneration, whisper, None),
    }
    for adapter_id, (cls, make, task) in adapters.items():
        base_dir = work / "bases" / adapter_id.split("/")[1]
        torch.manual_seed(0)
        base = cls.from_config(make()) if hasattr(cls, "from_config") else cls(make())
        base.save_pretrained(base_dir)
        try:
            save_focus_adapter(base, work / adapter_id, str(base_dir), task_type=task)
        except Exception as error:  # a refused base: the test then fails with the same refusal
            print(f"{adapter_id}: refused, {type(error).__name__}: {str(error)[:150]}")


# --------------------------------------------------------------------------------------------------- running
CONFTEST = '''"""Peer-suite run (scripts/peer_suites/peer.py): Focus registered before any test module imports PEFT."""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "stubs"))
import focus_hf  # noqa: E402,F401
'''


def offline_env(work: Path, hf_home: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_CACHE", "TRANSFORMERS_CACHE"):
        env.pop(name, None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", RUN_SLOW="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(work / "tests"))
    env["HF_HOME"] = str(hf_home if hf_home is not None else work / "hf_home")
    return env


def run_pytest(work: Path, files: list[str], junit: Path, env: dict[str, str], extra: list[str]) -> int:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-rfEs",
               f"--junitxml={junit}", *files, *extra]
    print("+", " ".join(command), flush=True)
    return subprocess.call(command, cwd=work, env=env)


def prepare_work(work: Path) -> Path:
    if work.exists():
        shutil.rmtree(work)
    (work / "tests").mkdir(parents=True)
    (work / "conftest.py").write_text(CONFTEST)
    shutil.copy(HERE / "focus_peer.py", work / "tests" / "focus_peer.py")
    return work / "tests"


def cmd_transformers(args: argparse.Namespace) -> int:
    work = args.work.resolve()
    tests = prepare_work(work)
    source, changed = substitute_imports(Path(args.test_file).read_text())
    (tests / "test_peft_integration.py").write_text(source)
    print(f"substituted {len(changed)} import lines: {sorted(set(changed))}")
    hf_home = work / "hf_home"
    fill_hub_cache(build_transformers_repos(work / "stage"), hf_home)
    junit = work / "transformers.xml"
    run_pytest(work, ["tests/test_peft_integration.py"], junit, offline_env(work, hf_home), args.pytest_args)
    return print_classification(junit, "transformers")


def cmd_peft(args: argparse.Namespace) -> int:
    work = args.work.resolve()
    tests = prepare_work(work)
    with tarfile.open(args.sdist) as archive:
        top = archive.getnames()[0].split("/")[0]
        members = [m for m in archive.getmembers() if m.name.startswith(f"{top}/tests/")]
        archive.extractall(work / "sdist", members=members, filter="data")
    shutil.copytree(work / "sdist" / top / "tests", tests, dirs_exist_ok=True)
    (tests / "__init__.py").touch()  # the sdist ships none; the tests import each other relatively (.testing_common)
    substitute_peft_suites(tests)
    stubs = work / "stubs"
    for name, body in (("datasets", "def load_dataset(*args, **kwargs):\n    raise RuntimeError('stubbed')\n"),
                       ("diffusers", "class StableDiffusionPipeline:\n    pass\n")):
        try:
            __import__(name)
        except ImportError:  # only other adapter types' tests use them
            (stubs / name).mkdir(parents=True)
            (stubs / name / "__init__.py").write_text(f"# peer-suite stub\n{body}")
    build_peft_folders(work)
    junit = work / "peft.xml"
    files = ["tests/test_decoder_models.py", "tests/test_config.py", "tests/test_auto.py"]
    env = offline_env(work, None)
    env["PYTHONPATH"] = ""  # PEFT's tests are a package (relative imports of tests.testing_common)
    run_pytest(work, files, junit, env, args.pytest_args)
    return print_classification(junit, "peft")


# --------------------------------------------------------------------------------------------------- classification
# (category, pattern on "test name + failure message"); the first match wins. A refusal is a failure whose message
# is one of Focus's documented refusals (docs/limitations.md); anything unmatched is reported as a DEFECT.
RULES: list[tuple[str, str]] = [
    ("LoRA-specific: LoRA's rank option (hotswapping adapters of different ranks)",
     r"does not take the option\(s\) \['r'\]"),
    ("refusal: GPT-J (attention outside transformers' registry)", r"^test\w*\[.*GPTJ"),
    ("refusal: merging", r"FocusMergeError|^test\w*merg"),
    ("refusal: pickles (save_pretrained(safe_serialization=False))", r"pickle|safe_serialization=False"),
    ("refusal: autocast_adapter_dtype=False on a half-precision base", r"routers are always float32"),
    ("refusal: training a model left in eval mode (hard routing: the routers get no gradient)",
     r"in hard routing mode|does not require grad"),
    ("refusal: unknown adapter_config.json keys", r"does not take the option"),
    ("refusal: several adapters at once", r"one adapter at a time|adapter_names"),
    ("refusal: missing or unexpected tensors in the adapter's weights",
     r"is missing \d+ router tensor|which is neither a Focus router tensor"),
    ("not runnable offline", r"couldn't connect to 'https://huggingface.co'|OfflineModeIsEnabled"),
]

# Failures whose message alone does not say why (an assertion), with the reason read from the test's code.
OVERRIDES: dict[str, dict[str, str]] = {
    "transformers": {
        # get_adapter_state_dict() keys are asserted to contain "lora"
        "test_peft_state_dict": "LoRA-specific: checks LoRA weight names",
        # from_pretrained leaves the model in eval mode and the test trains without model.train(): lm_head
        # (modules_to_save) gets its gradient, the routers none (hard routing), with the eval-mode warning
        # adapter modules are recognised by "lora_" in their names: Focus's trainable routers (focus_proj...) fall
        # in the branch that asserts frozen parameters
        "test_peft_load_adapter_training_inference_mode_false": "LoRA-specific: checks LoRA weight names",
        "test_peft_add_adapter_modules_to_save":
            "refusal: training a model left in eval mode (hard routing: the routers get no gradient)",
    },
    "peft": {
        # test_config.py: PeftConfig.from_pretrained of LoRA adapter repos on the Hub ("ybelkada/test-st-lora"...),
        # whose configs are LoraConfigs
        "test_from_pretrained": "LoRA-specific: loads a LoRA adapter repo from the Hub",
        "test_from_pretrained_cache_dir": "LoRA-specific: loads a LoRA adapter repo from the Hub",
        "test_save_pretrained_with_runtime_config": "LoRA-specific: loads a LoRA adapter repo from the Hub",
    },
}


def read_junit(path: Path) -> list[tuple[str, str, str, str]]:
    rows = []
    for case in ET.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = child.get("message") or ""  # the exception's own line(s), not the traceback
            elif child.tag == "skipped":
                outcome, message = "skipped", child.get("message") or ""
        rows.append((case.get("classname") or "", case.get("name") or "", outcome, message))
    return rows


def is_focus_case(suite: str, classname: str, name: str) -> bool:
    if suite == "transformers" or "test_auto" in classname:
        return True
    return "FocusConfig" in name


def classify(path: Path, suite: str) -> tuple[collections.Counter, list]:
    counts: collections.Counter = collections.Counter()
    details = []
    overrides = OVERRIDES.get(suite, {})
    for classname, name, outcome, message in read_junit(path):
        if not is_focus_case(suite, classname, name):
            counts[f"not a Focus case ({outcome})"] += 1
            continue
        if outcome != "failed":
            counts[outcome] += 1
            details.append((outcome, name, message.strip()[:160]))
            continue
        short = re.sub(r"\[.*", "", name)
        category = overrides.get(short)
        if category is None:
            text = f"{name}\n{message}"
            category = next((label for label, pattern in RULES if re.search(pattern, text)), "DEFECT")
        counts[category.split(":")[0]] += 1
        last = [line for line in message.splitlines() if line.strip()]
        details.append((category, name, (last[0] if last else "")[:200]))
    return counts, details


def print_classification(junit: Path, suite: str) -> int:
    counts, details = classify(junit, suite)
    for category, count in sorted(counts.items()):
        print(f"{count:5d}  {category}")
    print()
    for category, name, message in sorted(details):
        print(f"{category:60s} {name}  {message}")
    return 1 if counts.get("DEFECT") else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tf = sub.add_parser("transformers", help="transformers' tests/peft_integration/test_peft_integration.py")
    tf.add_argument("test_file", type=Path)
    tf.add_argument("--work", type=Path, default=Path("/tmp/focus-peer-transformers"))
    tf.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    pf = sub.add_parser("peft", help="PEFT's test_decoder_models.py, test_config.py and test_auto.py")
    pf.add_argument("sdist", type=Path)
    pf.add_argument("--work", type=Path, default=Path("/tmp/focus-peer-peft"))
    pf.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    cl = sub.add_parser("classify", help="classify an earlier run's junit xml")
    cl.add_argument("junit", type=Path)
    cl.add_argument("--suite", choices=("transformers", "peft"), required=True)
    args = parser.parse_args(argv)
    if args.command == "transformers":
        return cmd_transformers(args)
    if args.command == "peft":
        return cmd_peft(args)
    return print_classification(args.junit, args.suite)


if __name__ == "__main__":
    sys.exit(main())
