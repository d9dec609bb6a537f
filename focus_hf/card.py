"""Model cards (README.md) for Focus adapters, rendered from `hub_templates/model_card.md.j2`.

The card opens with how to use the adapter: the package to install (its name and the version that wrote the card)
and the lines the Hub's "Use this model" button shows for a PEFT adapter, built from `adapter_config.json` as the Hub
builds them. Its YAML front matter is what the Hub indexes: `library_name: peft`, the base model and the adapter
relation, tags, `pipeline_tag`, the license (the base model's, `focus_hf.hub.eval_results.base_model_license`, unless
given), the Hub datasets it was trained or evaluated on, and the adapter's own evaluation results
(`focus_hf.hub.eval_results`): `model-index` on a Hub dataset, `.eval_results/` on a Hub benchmark.
The body is built from files in the adapter folder: `adapter_config.json` and the safetensors header (via
`focus_hf.files.adapter_summary`), `training_log.json` (written by `focus_hf.fitting.trainer`), `eval_results.json`
and an interpretability summary; every part is optional except the adapter config. With interpretability data and
matplotlib installed, `write_model_card` also draws `group_balance.png` (see `focus_hf.interpret.chart`) into the
folder and the card embeds it with a relative link, so the Hub shows it once the folder is pushed.

Each generated part of the body is a marked section (`focus_hf.hub.cards`): `write_model_card` on a folder that holds
a README.md already replaces those sections and the metadata it generates, and keeps whatever else was written.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from focus_hf.files import CONFIG_NAME
from focus_hf.hub.eval_results import ppl
from focus_hf.interpret.chart import BALANCE_CHART_NAME, MATPLOTLIB_HINT, matplotlib_available, write_balance_chart

logger = logging.getLogger(__name__)

TEMPLATE_NAME = "model_card.md.j2"


def _template_path() -> Path:
    """The card template. The repository's hub_templates/ folder ships inside the package as `focus_hf.hub_templates`
    (see pyproject); a checkout (imported from its folder, installed in editable mode or not) reads the folder beside
    the package, so that the template and the code that fills it always come from the same tree."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file() and (checkout / "hub_templates" / TEMPLATE_NAME).is_file():
        return checkout / "hub_templates" / TEMPLATE_NAME
    return Path(str(resources.files("focus_hf.hub_templates") / TEMPLATE_NAME))


TEMPLATE_PATH = _template_path()
CARD_NAME = "README.md"
EVAL_RESULTS_NAME = "eval_results.json"
TRAINING_LOG_NAME = "training_log.json"
INTERPRETABILITY_NAME = "interpretability.json"
MAX_INTERPRETABILITY_ROWS = 12  # the purest groups shown in the card
TAGS = ["focus", "sparse-attention", "peft", "focus-hf"]
PACKAGE_NAME = "focus-hf"
# eval_results.json keys -> row label, in table order
_MODES = {"full": "base model, full attention (comparison)", "soft": "Focus, soft routing",
          "hard": "Focus, hard routing (sparse)"}  # fmt: skip
# PEFT task types the Hub's PEFT snippet knows -> the transformers auto class it names (AutoModelFor<...>).
HUB_SNIPPET_TASKS = {"CAUSAL_LM": "CausalLM", "SEQ_2_SEQ_LM": "Seq2SeqLM", "TOKEN_CLS": "TokenClassification",
                     "SEQ_CLS": "SequenceClassification"}  # fmt: skip


def _read_json(path: Path) -> Optional[Any]:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(
            f"{path} is not valid JSON ({error}); fix or remove it before writing the model card."
        ) from None


def _number(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _size(num_bytes: Optional[int]) -> str:
    if not num_bytes:
        return "missing"
    for unit, scale in (("MB", 1 << 20), ("kB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit} ({num_bytes:,} bytes)"
    return f"{num_bytes:,} bytes"


def hub_base_model(base: Optional[str]) -> Optional[str]:
    """The Hub id of an adapter's recorded base model, or None when it is not one (a local folder...).

    An alias of an embedded model (`smollm2-135m-instruct`) or its converted folder in focus_hf's cache maps to
    the original Hub id, so that the card links the real base model.
    """
    if not base:
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from focus_hf.aliases import MODEL_ALIASES, resolve_model_id

    base = resolve_model_id(base)
    local = os.path.isabs(base) or base.startswith((".", "~")) or os.path.exists(base)
    if local:
        alias = MODEL_ALIASES.get(Path(base).name.lower())
        return alias.hub_id if alias is not None else None
    try:
        validate_repo_id(base)
    except HFValidationError:
        return None
    return base


def _evaluation_rows(eval_results: dict) -> list[dict[str, str]]:
    full = ppl(eval_results.get("full"))
    rows = []
    for mode, label in _MODES.items():
        value = ppl(eval_results.get(mode))
        if value is None:
            continue
        entry = eval_results[mode]
        if mode != "full" and entry.get("top_k"):
            label += f", top-{entry['top_k']}"
        ratio = "1.00x" if mode == "full" else (f"{value / full:.3f}x" if full else "n/a")
        rows.append(
            {"label": label, "ppl": f"{value:.3f}", "ratio": ratio, "tokens": _number(entry.get("tokens", "n/a"))}
        )
    return rows


# eval_results.json keys -> what the Evaluation text says was measured
_MODE_TEXTS = {
    "full": "the base model with full attention",
    "soft": "the adapter with its soft (training-time) routing",
    "hard": "the adapter with its hard sparse pattern (inference)",
}


def _evaluated_text(modes: list[str]) -> str:
    """What the Evaluation table compares, naming only the rows it has."""
    texts = [_MODE_TEXTS[mode] for mode in modes]
    return ", ".join(texts[:-1]) + (" and " if len(texts) > 1 else "") + texts[-1] if texts else ""


def training_corpus(log: Any) -> Optional[str]:
    """The corpus a training log records (`focus-hf train` and the distillation write it in its metadata)."""
    if not isinstance(log, dict):
        return None
    metadata = log.get("metadata") if isinstance(log.get("metadata"), dict) else {}
    data = metadata.get("data") or metadata.get("dataset") or log.get("data")
    return str(data) if data else None


def _training_rows(log: dict) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    data = training_corpus(log)
    if data:
        rows.append(("training data", markdown_code(data, in_table=True)))
    fields = [
        ("steps", "steps"), ("tokens_seen", "tokens seen"), ("seq_len", "sequence length"),
        ("batch_size", "batch size"),
        ("gradient_accumulation_steps", "gradient accumulation"), ("lr", "learning rate"),
        ("lr_scheduler_type", "schedule"), ("train_loss", "mean training loss"), ("final_loss", "final loss"),
        ("wall_time_s", "training time (s)"), ("seed", "seed"),
    ]  # fmt: skip
    for key, label in fields:
        if log.get(key) is not None:
            rows.append((label, _number(log[key])))
    if log.get("base_weights"):
        rows.append(("base weights used in training", markdown_code(log["base_weights"], in_table=True)))
    heldout = log.get("heldout_dominance")
    if isinstance(heldout, dict) and heldout.get("max") is not None:
        rows.append(("largest group share (held-out)", _number(heldout["max"], 3)))
    versions = log.get("versions")
    if isinstance(versions, dict) and versions:
        rows.append(("versions", ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))))
    return rows


def markdown_code(text: Any, *, in_table: bool = False):
    """`text` as an inline code span that Markdown renderers show verbatim: no HTML escaping (a renderer shows an
    entity inside a code span literally), a backtick fence longer than any run of backticks inside, and, for a table
    cell, pipes escaped (GFM removes the backslash, also inside code spans)."""
    import markupsafe

    text = str(text).replace("\r", "\\r").replace("\n", "\\n")
    if not text:
        return markupsafe.Markup("(empty)")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    span = f"{fence}{pad}{text}{pad}{fence}"
    return markupsafe.Markup(span.replace("|", "\\|") if in_table else span)


# ASCII punctuation that Markdown (or the HTML inside it, or the Hub's math) reads as syntax inside a line.
_MARKDOWN_SYNTAX = re.compile(r"([\\`*_\[\]<>!|#~&$])")


def markdown_text(value: Any):
    """`value` as plain text inside a line of Markdown: whitespace runs (newlines too) become one space, and the
    characters Markdown, HTML or math would read as syntax are backslash-escaped (a renderer shows them as they are,
    where an HTML entity would show literally inside code); a leading character that could open a list or a heading
    is escaped as well."""
    import markupsafe

    if isinstance(value, markupsafe.Markup):
        return value
    text = " ".join(str(value).split())
    text = _MARKDOWN_SYNTAX.sub(r"\\\1", text)
    text = re.sub(r"^([-+=])(?=\s|$|\1)", r"\\\1", text)
    text = re.sub(r"^(\d+)([.)])(?=\s|$)", r"\1\\\2", text)
    return markupsafe.Markup(text)


def markdown_url(path: str):
    """A link target: `path` percent-encoded (slashes kept), so that no character of it is Markdown syntax."""
    import urllib.parse

    import markupsafe

    return markupsafe.Markup(urllib.parse.quote(str(path), safe="/"))


def _token_label(token: Any):
    """A token as a code span: spaces shown as ␣, newlines and tabs as escapes."""
    return markdown_code(str(token).replace(" ", "\u2423").replace("\t", "\\t"), in_table=True)


def _interpretability_context(data: Any) -> Optional[dict]:
    """{"summary": str, "rows": [...]} from an interpretability dict (as `focus-hf inspect --json` writes:
    {"summary": ..., "layers": [{"layer": i, "groups": [{"group", "share", "dominant_category", "purity",
    "top_tokens"}]}]}); unknown shapes give the summary only."""
    import markupsafe

    if not isinstance(data, dict):
        return None
    rows = []
    for layer in data.get("layers") or []:
        if not isinstance(layer, dict):
            continue
        for group in layer.get("groups") or []:
            if not isinstance(group, dict):
                continue
            tokens = group.get("top_tokens") or []
            words = [t[0] if isinstance(t, (list, tuple)) and t else t for t in tokens[:5]]
            rows.append({
                "layer": layer.get("layer", "?"),
                "group": group.get("group", "?"),
                "share": f"{group['share']:.1%}" if isinstance(group.get("share"), (int, float)) else "n/a",
                "category": group.get("dominant_category") or "n/a",
                "purity": f"{group['purity']:.0%}" if isinstance(group.get("purity"), (int, float)) else "n/a",
                "tokens": markupsafe.Markup(" ").join(_token_label(w) for w in words),
                "_purity": group["purity"] if isinstance(group.get("purity"), (int, float)) else -1.0,
            })  # fmt: skip
    summary = data.get("summary")
    if not rows and not summary:
        return None
    total = len(rows)
    rows = sorted(rows, key=lambda row: -row["_purity"])[:MAX_INTERPRETABILITY_ROWS]
    for row in rows:
        del row["_purity"]
    return {"summary": str(summary) if summary else "", "rows": rows, "total": total}


# eval_results.json "speed" keys -> row label, in table order (`focus-hf demo` writes the first eight).
_SPEED_LABELS = {
    "seq_len": "prompt length (tokens)",
    "full_seconds": "prefill, full attention (s)",
    "hard_seconds": "prefill, Focus hard routing (s)",
    "speedup": "speed-up (full / Focus)",
    "top_k": "groups each query probes (top-k)",
    "repeats": "timed prefills per variant (best kept)",
    "backend": "Focus attention backend",
    "threads": "CPU threads",
    "full_ms": "prefill, full attention (ms)",
    "hard_ms": "prefill, Focus hard routing (ms)",
}


def _cell(value: Any):
    """A table cell: a number as text, anything else (strings, lists) as code, as the JSON file holds it."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number(value)
    return markdown_code(value if isinstance(value, str) else json.dumps(value), in_table=True)


def _speed_rows(speed: dict) -> list[tuple[Any, Any]]:
    """(label, value) rows of the Speed table: known keys by name and in `_SPEED_LABELS` order, others as code."""
    keys = [key for key in _SPEED_LABELS if key in speed] + [key for key in speed if key not in _SPEED_LABELS]
    rows = []
    for key in keys:
        value = speed[key]
        if key == "speedup" and isinstance(value, (int, float)) and not isinstance(value, bool):
            shown = f"{value:.2f}x"
        else:
            shown = _cell(value)
        rows.append((_SPEED_LABELS.get(key) or markdown_code(key, in_table=True), shown))
    return rows


def _passkey_summary(passkey: Any) -> Optional[dict]:
    """{"seq_len", "prompts", "base", "focus"} from the "passkey" entry `focus-hf demo` writes, or None."""
    if not isinstance(passkey, dict) or not isinstance(passkey.get("cases"), list) or not passkey["cases"]:
        return None
    cases = [case for case in passkey["cases"] if isinstance(case, dict)]
    seq_len = passkey.get("seq_len")
    return {
        "seq_len": f"{seq_len:,}" if isinstance(seq_len, int) and not isinstance(seq_len, bool) else None,
        "prompts": len(cases),
        "base": sum(case.get("base_ok") is True for case in cases),
        "focus": sum(case.get("focus_ok") is True for case in cases),
    }


def python_string_literal(value: Any):
    """`value` as a Python string literal for the card's code snippet (quotes, backslashes, newlines escaped)."""
    import markupsafe

    return markupsafe.Markup(json.dumps(str(value), ensure_ascii=True))


def shell_word(value: Any):
    """`value` as one shell word for the card's command line (`shlex.quote`; dicts and lists as JSON first)."""
    import shlex

    import markupsafe

    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return markupsafe.Markup(shlex.quote(text))


def package_info() -> dict[str, Optional[str]]:
    """The package that writes the card: its name, the installed version, the pip requirement pinning it, and a web
    page only when the package's own metadata names one (`Project-URL` or `Home-page`), never a guessed address."""
    import importlib.metadata

    import focus_hf

    try:
        metadata = importlib.metadata.metadata(PACKAGE_NAME)
        version = metadata["Version"]
        urls = [value.partition(",")[2].strip() for value in metadata.get_all("Project-URL") or []]
        url = next((u for u in urls + [metadata.get("Home-page") or ""] if u.startswith("https://")), None)
    except importlib.metadata.PackageNotFoundError:  # imported from a checkout that was not installed
        version, url = focus_hf.__version__, None
    return {"name": PACKAGE_NAME, "version": version, "requirement": f"{PACKAGE_NAME}=={version}", "url": url}


def hub_peft_snippet(repo_id: str, config: dict[str, Any]):
    """The code the Hub's "Use this model" button shows for a PEFT adapter, built from its `adapter_config.json` as
    the Hub builds it (huggingface.js, `model-libraries-snippets.ts`, `peft`): None where the Hub shows none (an
    unknown `task_type`, or no base model)."""
    import markupsafe

    task = HUB_SNIPPET_TASKS.get(config.get("task_type") or "")
    base = config.get("base_model_name_or_path")
    if task is None or not base:
        return None
    return markupsafe.Markup(
        f"from peft import PeftModel\nfrom transformers import AutoModelFor{task}\n\n"
        f"base_model = AutoModelFor{task}.from_pretrained({python_string_literal(base)})\n"
        f"model = PeftModel.from_pretrained(base_model, {python_string_literal(repo_id)})"
    )


def _snippet_note(config: dict[str, Any], base_model: Optional[str]):
    """Why the Hub's button shows no loading code for this adapter (Markdown)."""
    import markupsafe

    code = markdown_code
    if (config.get("task_type") or "") not in HUB_SNIPPET_TASKS:
        return markupsafe.Markup(
            f"The Hub shows no loading code for this adapter: its {code(CONFIG_NAME)} names no {code('task_type')} "
            f"(saving it again with focus_hf records {code('CAUSAL_LM')} there); the lines above load it all the "
            "same."
        )
    if not base_model:
        return markupsafe.Markup(
            "The base model is not on the Hub: load the one the adapter was fitted on in place of "
            f"{code('BASE_MODEL')}."
        )
    return markupsafe.Markup(
        f"The Hub shows no loading code for this adapter: its {code(CONFIG_NAME)} records the base model as "
        f"{code(config.get('base_model_name_or_path'))}, not as its Hub id."
    )


def _card_license(license: Optional[str], base_license: Optional[dict]) -> tuple[dict[str, str], Optional[str]]:  # noqa: A002
    """(license metadata, a note for the card) from an explicit license, else the base model's."""
    if license:
        return {"license": license}, None
    if base_license:
        return dict(base_license), None
    return {}, (
        "No license is set: the base model's card names none that could be read. Set one with `focus-hf card "
        "--license`; an adapter of a base model under its own license (Llama, Gemma...) follows that license."
    )


def render_model_card(
    adapter_dir: str | os.PathLike,
    *,
    eval_results: Optional[dict] = None,
    interpretability: Optional[dict] = None,
    repo_id: Optional[str] = None,
    license: Optional[str] = None,  # noqa: A002
    base_license: Optional[dict] = None,
    balance_chart: Optional[str] = None,
):
    """The model card of an adapter folder as a `huggingface_hub.ModelCard` (not written anywhere).

    See `write_model_card` for the other arguments. `balance_chart` is the path, relative to the card, of a
    group-balance image to embed (`write_model_card` draws it); without one and without matplotlib, the card says
    in one line how to get the chart.
    """
    import jinja2
    import markupsafe
    from huggingface_hub import ModelCard, ModelCardData

    from focus_hf.files import adapter_summary
    from focus_hf.hub.datasets import parse_hub_dataset
    from focus_hf.hub.eval_results import evaluated_corpus, headline, model_index_results

    folder = Path(adapter_dir)
    summary = adapter_summary(folder)
    config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    if eval_results is None:
        eval_results = _read_json(folder / EVAL_RESULTS_NAME)
    if interpretability is None:
        interpretability = _read_json(folder / INTERPRETABILITY_NAME)
    training_log = _read_json(folder / TRAINING_LOG_NAME)
    eval_results = eval_results if isinstance(eval_results, dict) else {}
    base_model = hub_base_model(summary["base_model"])
    name = repo_id.split("/")[-1] if repo_id else folder.resolve().name
    repo_id = repo_id or f"your-namespace/{name}"
    corpus = evaluated_corpus(eval_results)
    results = model_index_results(eval_results, corpus)
    trained_on = parse_hub_dataset(training_corpus(training_log) or "")
    datasets = list(dict.fromkeys(d.repo_id for d in (trained_on, corpus.hub if corpus else None) if d is not None))
    license_metadata, license_note = _card_license(license, base_license)
    package = package_info()

    card_data = ModelCardData(
        base_model=base_model,
        library_name="peft",
        **license_metadata,
        pipeline_tag="text-generation",
        tags=list(TAGS),
        datasets=datasets or None,
        model_name=name if results else None,
        eval_results=results or None,
        base_model_relation="adapter" if base_model else None,
        focus_hf=headline(eval_results, config, package["version"]),
    )
    speed = eval_results.get("speed")
    evaluation = _evaluation_rows(eval_results)
    # The Hub's lines, shown only where they run as shown: the config must name the base by its Hub id.
    recorded_base = config.get("base_model_name_or_path")
    snippet = hub_peft_snippet(repo_id, config) if base_model and recorded_base == base_model else None
    context = {
        "card_data": card_data.to_yaml(),
        "title": f"{name}: Focus sparse-attention adapter" + (f" for {base_model}" if base_model else ""),
        "package": package,
        "snippet": snippet,
        "snippet_note": None if snippet else _snippet_note(config, base_model),
        "base_revision": config.get("revision"),
        "base_model": base_model,
        "base_model_label": base_model or summary["base_model"],
        "repo_id": repo_id,
        "summary": summary,
        "size_text": _size(summary["weights_bytes"]),
        "training": _training_rows(training_log) if isinstance(training_log, dict) else [],
        "config_rows": [(markdown_code(key, in_table=True), _cell(value)) for key, value in summary["config"].items()],
        "evaluation": evaluation,
        "has_base_row": ppl(eval_results.get("full")) is not None,
        "evaluated": _evaluated_text([mode for mode in _MODES if ppl(eval_results.get(mode)) is not None]),
        "eval_data": corpus.name if corpus else None,
        "eval_data_link": f"https://huggingface.co/datasets/{corpus.hub.repo_id}" if corpus and corpus.hub else None,
        "eval_documents": corpus.split if corpus else None,
        "speed": _speed_rows(speed) if isinstance(speed, dict) else [],
        "passkey": _passkey_summary(eval_results.get("passkey")),
        "interpretability": _interpretability_context(interpretability),
        "balance_chart": balance_chart,
        "balance_chart_note": None,
        "base_weights": training_log.get("base_weights") if isinstance(training_log, dict) else None,
        "license_note": license_note,
    }
    if context["interpretability"] and balance_chart is None and not matplotlib_available():
        context["balance_chart_note"] = markupsafe.Markup(
            f"The group-balance chart ({markdown_code(BALANCE_CHART_NAME)}) is left out: matplotlib is not installed "
            f"({markdown_code(MATPLOTLIB_HINT)}, then rerun `focus-hf card`)."
        )
    # Every value is escaped for where it goes (config values come from the adapter folder, possibly someone
    # else's): as Markdown text by default (`markdown_text`), as a code span (`code`, `cell_code`), as a Python
    # string literal in the usage snippet. Only the YAML block that huggingface_hub serialised is inserted as is.
    context["card_data"] = markupsafe.Markup(context["card_data"])
    environment = jinja2.Environment(
        keep_trailing_newline=True, undefined=jinja2.ChainableUndefined, autoescape=False, finalize=markdown_text
    )
    environment.filters["python_string"] = python_string_literal
    environment.filters["shell_word"] = shell_word
    environment.filters["code"] = markdown_code
    environment.filters["url"] = markdown_url
    environment.filters["cell_code"] = functools.partial(markdown_code, in_table=True)
    content = environment.from_string(TEMPLATE_PATH.read_text(encoding="utf-8")).render(**context)
    while "\n\n\n" in content:
        content = content.replace("\n\n\n", "\n\n")
    return ModelCard(content)


def write_model_card(
    adapter_dir: str | os.PathLike,
    *,
    eval_results: Optional[dict] = None,
    interpretability: Optional[dict] = None,
    repo_id: Optional[str] = None,
    license: Optional[str] = None,  # noqa: A002
    base_license: Optional[dict] = None,
) -> Path:
    """Write `README.md`, the Hub model card, into a Focus adapter folder and return its path.

    A README.md already in the folder is updated, not overwritten: its metadata and the sections focus_hf generates
    are replaced, and everything else written in it is kept (`focus_hf.hub.cards.update_card`). With interpretability
    data, also draws the group-balance chart into the folder as `group_balance.png` (overwriting it) and embeds it;
    without matplotlib the card leaves the chart out with a one-line note. Evaluation results on a Hub benchmark are
    also written as `.eval_results/focus-hf-perplexity.yaml` (the Hub's format; `push_adapter` uploads it).

    Nothing is read from the network: the base model's license is passed in (`base_license`, as
    `focus_hf.hub.eval_results.base_model_license` reads it; `focus-hf card` does).

    Args:
        adapter_dir: a saved Focus adapter folder (`adapter_config.json` + `adapter_model.safetensors`).
        eval_results: {"full": {"ppl", "tokens", ...}, "soft": {...}, "hard": {...}, "speed": {...}} as
            `focus_hf.evaluation.perplexity` returns per mode; defaults to the folder's `eval_results.json`.
            Any part may be missing; the adapter's own perplexities on a Hub dataset go into the card's
            `model-index`, the base model's ("full") is a comparison in its text.
        interpretability: a summary of what the groups learned (see `_interpretability_context`; a
            `focus-hf inspect` report); defaults to the folder's `interpretability.json`.
        repo_id: the Hub id shown in the loading snippet; defaults to a placeholder.
        license: the card's license (a Hub license id); overrides `base_license`.
        base_license: the base model's license metadata (`license`, and `license_name` / `license_link` for
            `license: other`); without either, the card sets no license and says so.

    Raises:
        focus_hf.files.AdapterFileError: not a Focus adapter folder.
        ValueError: a JSON file of the folder is invalid, or its README.md has metadata that is not YAML.
    """
    from focus_hf.hub.cards import update_card
    from focus_hf.hub.eval_results import eval_result_entries, evaluated_corpus, write_eval_results_file

    folder = Path(adapter_dir)
    if interpretability is None:
        interpretability = _read_json(folder / INTERPRETABILITY_NAME)
    chart = None
    if (folder / CONFIG_NAME).is_file():  # not an adapter folder: render_model_card raises, nothing is written
        chart = write_balance_chart(interpretability, folder / BALANCE_CHART_NAME, title="Focus group balance")
        stale = folder / BALANCE_CHART_NAME
        if chart is None and stale.is_file():
            # An earlier chart no longer matches this card, and push would upload it beside the card.
            logger.warning("Removing %s: it cannot be redrawn for this card (no matplotlib or no data).", stale)
            stale.unlink()
    card = render_model_card(
        folder, eval_results=eval_results, interpretability=interpretability, repo_id=repo_id, license=license,
        base_license=base_license, balance_chart=chart.name if chart is not None else None,
    )  # fmt: skip
    if eval_results is None:
        eval_results = _read_json(folder / EVAL_RESULTS_NAME)
    eval_results = eval_results if isinstance(eval_results, dict) else {}
    entries = eval_result_entries(eval_results, evaluated_corpus(eval_results), package_info()["version"])
    write_eval_results_file(folder, entries)
    path = folder / CARD_NAME
    text = str(card)
    if path.is_file():
        text = update_card(path.read_text(encoding="utf-8"), text)
    path.write_text(text, encoding="utf-8")
    return path
