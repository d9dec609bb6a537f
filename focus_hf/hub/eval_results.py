"""What a model card's metadata says about an adapter, in the Hub's formats, from the files of its folder.

- Evaluation results are the adapter's own: perplexity with Focus routing (soft, hard). The base model's figure
  measured beside them is a comparison, shown in the card's text, never listed as a result of the adapter.
- Results go into ``model-index`` only when measured on a Hub dataset (``hf://datasets/...``, `focus_hf.hub.datasets`),
  which then links to it (``dataset.type`` is its id, ``dataset.revision`` the commit read); the card also lists it
  under ``datasets``. A local or built-in corpus has a name in the card and no link.
- When that dataset is a Hub benchmark (it has an ``eval.yaml``), the hard-routing result is also written in the
  Hub's newer format, ``.eval_results/*.yaml`` (huggingface_hub's `EvalResultEntry`), which `push_adapter` uploads.
- The license follows the base model's card (`base_model_license`).
- ``focus_hf`` holds the headline figures `focus-hf search` shows (`headline`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Optional

from focus_hf.hub.datasets import HubDataset, parse_hub_dataset

logger = logging.getLogger(__name__)

# eval_results.json keys of the adapter's own results -> what they measured.
FOCUS_MODES = {"soft": "Focus soft routing", "hard": "Focus hard routing"}
EVAL_RESULTS_FILE = ".eval_results/focus-hf-perplexity.yaml"
LICENSE_KEYS = ("license", "license_name", "license_link")


@dataclasses.dataclass(frozen=True)
class EvaluatedCorpus:
    """The corpus an evaluation read: the name the card shows, the Hub dataset (pinned to a commit) when it is one,
    the documents scored (focus_hf's `split`: heldout, train, all) and the benchmark task ids of the dataset."""

    name: str
    hub: Optional[HubDataset]
    split: Optional[str]
    benchmark_tasks: tuple[str, ...] = ()


def ppl(entry: Any) -> Optional[float]:
    """The perplexity of one eval_results.json entry, or None."""
    if isinstance(entry, dict) and isinstance(entry.get("ppl"), (int, float)) and not isinstance(entry["ppl"], bool):
        value = float(entry["ppl"])
        return value if math.isfinite(value) else None
    return None


def evaluated_corpus(eval_results: dict) -> Optional[EvaluatedCorpus]:
    """The corpus of the perplexities in `eval_results` (each entry's ``data``, or a local file's ``data_file``).

    Raises:
        ValueError: an ``hf://datasets/`` value that is no valid Hub dataset spec.
    """
    for mode in ("full", *FOCUS_MODES):
        entry = eval_results.get(mode)
        if not isinstance(entry, dict):
            continue
        name = entry.get("data") or entry.get("data_file")
        if not name:
            continue
        split = entry.get("split") if isinstance(entry.get("split"), str) else None
        hub = parse_hub_dataset(name)
        tasks = tuple(str(task) for task in entry.get("benchmark_tasks") or ())
        return EvaluatedCorpus(hub.spec if hub else str(name), hub, split, tasks if hub else ())
    data = eval_results.get("data")
    return EvaluatedCorpus(str(data), parse_hub_dataset(data), None) if isinstance(data, str) and data else None


def _result_label(mode: str, entry: dict) -> str:
    top_k = entry.get("top_k")
    return FOCUS_MODES[mode] + (f", top-{top_k}" if mode == "hard" and top_k else "")


def model_index_results(eval_results: dict, corpus: Optional[EvaluatedCorpus]) -> list:
    """huggingface_hub `EvalResult`s (the card's ``model-index``): the adapter's own perplexities on a Hub dataset;
    none for a corpus that is no Hub dataset (nothing to link to)."""
    from huggingface_hub import EvalResult

    if corpus is None or corpus.hub is None:
        return []
    return [
        EvalResult(
            task_type="text-generation",
            task_name="Language modeling",
            dataset_type=corpus.hub.repo_id,
            dataset_name=corpus.hub.repo_id,
            dataset_revision=corpus.hub.revision,
            dataset_args={"path": corpus.hub.path, "documents": corpus.split} if corpus.hub.path else None,
            metric_type="perplexity",
            metric_name=f"Perplexity, {_result_label(mode, eval_results[mode])}",
            metric_value=round(ppl(eval_results[mode]), 4),
        )
        for mode in FOCUS_MODES
        if ppl(eval_results.get(mode)) is not None
    ]


def eval_result_entries(eval_results: dict, corpus: Optional[EvaluatedCorpus], version: str) -> list:
    """huggingface_hub `EvalResultEntry`s (``.eval_results/``): the hard-routing perplexity, when the corpus is a Hub
    benchmark with one task (with several, which one was measured is not known: none is written)."""
    from huggingface_hub import EvalResultEntry

    entry = eval_results.get("hard")
    if corpus is None or corpus.hub is None or not corpus.benchmark_tasks or ppl(entry) is None:
        return []
    if len(corpus.benchmark_tasks) != 1:
        logger.info("Not writing %s: %s defines several tasks %s.", EVAL_RESULTS_FILE, corpus.hub.repo_id,
                    list(corpus.benchmark_tasks))  # fmt: skip
        return []
    return [
        EvalResultEntry(
            dataset_id=corpus.hub.repo_id,
            task_id=corpus.benchmark_tasks[0],
            value=round(ppl(entry), 4),
            dataset_revision=corpus.hub.revision,
            notes=f"perplexity (lower is better), {_result_label('hard', entry)}, focus-hf {version}",
        )
    ]


def write_eval_results_file(folder: Path, entries: list) -> Optional[Path]:
    """Write `entries` as ``.eval_results/focus-hf-perplexity.yaml`` in `folder` (or remove a stale one when there
    are none); returns the file written."""
    import yaml
    from huggingface_hub import eval_result_entries_to_yaml

    path = folder / EVAL_RESULTS_FILE
    if not entries:
        if path.is_file():
            logger.warning("Removing %s: the evaluation results no longer name a Hub benchmark.", path)
            path.unlink()
        return None
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(eval_result_entries_to_yaml(entries), sort_keys=False), encoding="utf-8")
    return path


def base_model_license(base_model: str, *, token: str | bool | None = None) -> Optional[dict[str, str]]:
    """The license of a base model's card on the Hub: ``{"license": ...}``, with ``license_name`` and
    ``license_link`` for ``license: other`` (a relative link made absolute), or None when the card names none.

    Raises:
        huggingface_hub.errors: the base model cannot be read (not found, gated, offline...).
    """
    from huggingface_hub import HfApi, constants

    card = HfApi(token=token).model_info(base_model).card_data
    found = {key: getattr(card, key, None) for key in LICENSE_KEYS} if card is not None else {}
    found = {key: str(value) for key, value in found.items() if value}
    if "license" not in found:
        return None
    link = found.get("license_link")
    if link and "://" not in link:
        found["license_link"] = f"{constants.ENDPOINT}/{base_model}/blob/main/{link.lstrip('./')}"
    return found


def headline(eval_results: dict, config: dict, version: str) -> dict[str, Any]:
    """The figures `focus-hf search` shows for an adapter (the card's ``focus_hf`` metadata): groups, top-k, window,
    the hard-routing perplexity against the base model's on the same text, the prefill speed-up, and the length they
    were measured at."""
    figures: dict[str, Any] = {"version": version}
    for key in ("num_groups", "top_k", "window"):
        if isinstance(config.get(key), int):
            figures[key] = config[key]
    full, hard = ppl(eval_results.get("full")), ppl(eval_results.get("hard"))
    if full and hard:
        figures["perplexity_ratio"] = round(hard / full, 4)
        seq_len = eval_results["hard"].get("seq_len")
        if isinstance(seq_len, int) and not isinstance(seq_len, bool):
            figures["context_length"] = seq_len
    speed = eval_results.get("speed")
    if isinstance(speed, dict) and isinstance(speed.get("speedup"), (int, float)) and math.isfinite(speed["speedup"]):
        figures["speedup"] = round(float(speed["speedup"]), 3)
        if isinstance(speed.get("seq_len"), int):
            figures.setdefault("context_length", speed["seq_len"])
    return figures
