"""Share Focus adapters on the Hugging Face Hub.

A Focus adapter is a small PEFT adapter folder: ``adapter_config.json`` (with ``"peft_type": "FOCUS"``) and
``adapter_model.safetensors``, plus an optional ``README.md`` model card, interpretability files (``*.json``,
``*.png``, ``*.html``) and the Hub's evaluation results (``.eval_results/*.yaml``). [`push_adapter`] uploads such a
folder in a single commit ([`plan_push`] says beforehand what it will add, update and delete) and [`pull_adapter`]
downloads it back, verified, through the regular ``huggingface_hub`` cache (so it also works offline once
downloaded).

Nothing a user made is deleted or overwritten: a push adds and updates files (it deletes files of the repo only when
asked, and keeps the edits of a README edited on the Hub); a pull copies into a folder only when it is empty or was
written by an earlier pull.

Safety rules, enforced on both sides:

- only safetensors weights: pickle files (``*.bin``, ``*.pt``, ``*.pth``, ``*.pkl``, ``*.pickle``, ``*.ckpt``,
  ``*.joblib``) are refused, whether in the folder to push or in the repo to pull;
- only the adapter: base-model weight files (``model*.safetensors``, any other ``*.safetensors``, shard
  indexes, ``*.gguf``...) are refused on push and never downloaded on pull; the ``checkpoints/`` folder that
  ``focus-hf train`` keeps for resuming is skipped on push (with a logged warning), pickles and all;
- downloads are verified: ``huggingface_hub`` itself only checks that a downloaded file has the size announced
  by the server, so [`pull_adapter`] checks every file against the checksums of the Hub's listing of its commit
  (``HfApi.verify_repo_checksums``: git blob sha1 for regular files, sha256 for LFS files; offline, the checksum
  the cache filed it under) and parses the safetensors header, and evicts a corrupt file from the cache before
  raising [`AdapterIntegrityError`].

The endpoint, cache and offline mode are those of ``huggingface_hub`` (``HF_ENDPOINT``, ``HF_HOME``/
``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``), read when each function is called.

Safetensors files are checked by `focus_hf.files.read_safetensors_header`, the same strict check the
core runs before a Focus adapter is injected into a model.

Loading straight from the Hub needs none of this package's functions: ``model.load_adapter("org/name")``
(transformers; a revision goes in ``adapter_kwargs={"revision": ...}``) and
``PeftModel.from_pretrained(base, "org/name", revision=...)`` work once focus_hf is installed (the package registers
Focus with PEFT when peft is imported; ``import focus_hf`` does it too). Before injecting, the Focus tuner runs
[`resolve_adapter_weights`] with the loader's own revision / cache / token arguments: the same revision's
``adapter_config.json`` and ``adapter_model.safetensors`` are checked against the Hub's checksums and the weights
against the safetensors format, so a truncated or tampered download is refused with the model left untouched.

Modules: `focus_hf.hub.push` and `focus_hf.hub.pull` (the two operations), `focus_hf.hub.loading` (the check
run by the loaders), `focus_hf.hub.integrity` (checksums and cache eviction), `focus_hf.hub.cards` (generated and
hand-written parts of a model card), `focus_hf.hub.eval_results` (the card's Hub metadata: evaluation results,
datasets, license), `focus_hf.hub.datasets` (corpora in Hub dataset repos), `focus_hf.hub.discovery` (finding
shared adapters) and `focus_hf.hub.repo_ids` (repo id / revision validation). What an adapter folder may hold
lives in `focus_hf.files`, the errors in `focus_hf.errors`. Import the public names from `focus_hf.hub` itself.
"""

from __future__ import annotations

from focus_hf.errors import (
    AdapterFolderError,
    AdapterIntegrityError,
    FocusHubError,
    HubPushError,
    InvalidRepoIdError,
    NotAFocusAdapterError,
)
from focus_hf.files import ADAPTER_FILE_PATTERNS, PICKLE_SUFFIXES
from focus_hf.files import CONFIG_NAME as ADAPTER_CONFIG_NAME
from focus_hf.files import PEFT_TYPE_NAME as FOCUS_PEFT_TYPE
from focus_hf.files import WEIGHTS_NAME as ADAPTER_WEIGHTS_NAME
from focus_hf.hub.loading import resolve_adapter_weights
from focus_hf.hub.pull import pull_adapter
from focus_hf.hub.push import PushPlan, plan_push, push_adapter
from focus_hf.hub.repo_ids import validate_repo_id

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "ADAPTER_FILE_PATTERNS",
    "FOCUS_PEFT_TYPE",
    "PICKLE_SUFFIXES",
    "FocusHubError",
    "InvalidRepoIdError",
    "AdapterFolderError",
    "NotAFocusAdapterError",
    "AdapterIntegrityError",
    "HubPushError",
    "validate_repo_id",
    "push_adapter",
    "plan_push",
    "PushPlan",
    "pull_adapter",
    "resolve_adapter_weights",
]
