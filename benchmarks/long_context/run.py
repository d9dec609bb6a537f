"""Lossless long context benchmark on SmolLM2-135M-Instruct: dense, a distilled Focus adapter, training-free baselines.

Stages (each appends to its JSON in benchmarks/long_context/results/):

    python benchmarks/long_context/run.py ppl --seq-len 8192 --blocks 2          # python-docs held-out
    python benchmarks/long_context/run.py ppl --seq-len 8192 --blocks 1 --data python-source
    python benchmarks/long_context/run.py ppl --seq-len 4096 --blocks 2
    python benchmarks/long_context/run.py passkey --lengths 1024 2048 4096 8192
    python benchmarks/long_context/run.py speed --lengths 512 1024 2048 4096 8192
    python benchmarks/long_context/run.py generate --lengths 16384 --new-tokens 64
    python benchmarks/long_context/run.py audit --windows 128 512 --dense-heads 0 --blocks 1
    python benchmarks/long_context/run.py plot

"dense" is the base model without any adapter (transformers' own SDPA attention). Focus variants load the committed
adapter (`adapter/`) and change only what the variant names: top_k, and dense heads calibrated from the adapter's
recall audit. Baselines (baselines.py) run on the base model: window + sinks only (StreamingLLM) and block
selection at the density of Focus top-1 (Quest / MInference-style). Every figure is measured in the run that
writes it; the report (`report.md`) is generated from the JSON by the `plot` stage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import baselines
import torch
import torch.nn.functional as F
from peft import PeftModel

import focus_hf
from focus_hf import load_model_and_tokenizer
from focus_hf.aliases import DEFAULT_MODEL
from focus_hf.attention.pattern import probed_distant_keys
from focus_hf.data import load_texts, passkey_prompt, split_texts, token_blocks
from focus_hf.evaluation import passkey_answer
from focus_hf.interpret.groups import record_routing

HERE = Path(__file__).resolve().parent
ADAPTER = HERE / "adapter"
RESULTS = HERE / "results"
SCORE_CHUNK = 2048


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0]}


def append(name: str, rows: list[dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    existing = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(existing + rows, indent=1) + "\n")


def command_line() -> str:
    return f"python benchmarks/long_context/{Path(sys.argv[0]).name} " + " ".join(sys.argv[1:])


# --- models ----------------------------------------------------------------------------------------------------


def load_dense():
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    return model.eval(), tokenizer


def load_focus(adapter: Path = ADAPTER):
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    return PeftModel.from_pretrained(model, adapter).eval(), tokenizer


def apply_variant(model, variant: dict) -> None:
    """Switch to the variant's setting at run time (`focus_hf.configure_adapter`; the saved files are not touched).

    A wider window than the adapter was distilled with only adds visible keys (the local pairs), so it is a
    setting a user can change after training; dense heads and dense_below only add dense attention.
    """
    focus_hf.configure_adapter(
        model,
        top_k=variant["top_k"],
        probe_mass=variant.get("probe_mass"),
        window=variant["window"],
        dense_heads=variant["dense_heads"] or None,
        dense_below=variant["dense_below"],
    )
    focus_hf.set_routing(model, "hard")


def variant_label(
    top_k: int, window: int, dense_heads: int, dense_below: int, saved: bool = False, probe_mass=None
) -> str:
    below = f", dense below {dense_below}" if dense_below else ""
    probes = f"top-{top_k}" if probe_mass is None else f"adaptive p={probe_mass:g} (at most {top_k})"
    return f"focus{' as saved' if saved else ''} {probes}, w={window}, {dense_heads} dense heads{below}"


def focus_variants(model, args) -> list[dict]:
    """The adapter as saved (no sweep option given), else every top_k x dense-head count x window of the sweep.

    Swept dense heads are the adapter's first N by its recall audit (`adapter_audit.json`), or the adapter's own
    dense heads when `--dense-heads` is not given; `--dense-below` (default 0) applies to every swept variant.
    """
    config = model.peft_config["default"]
    if args.top_k is None and args.dense_heads is None and args.windows is None and args.probe_mass is None:
        pairs = config.dense_heads or []
        label = variant_label(
            config.top_k, config.window, len(pairs), config.dense_below, saved=True, probe_mass=config.probe_mass
        )
        return [
            {
                "top_k": config.top_k,
                "probe_mass": config.probe_mass,
                "dense_heads": pairs,
                "window": config.window,
                "dense_below": config.dense_below,
                "label": label,
            }
        ]
    audit_path = HERE / "adapter_audit.json"
    ranked = []
    if audit_path.exists():
        rows = json.loads(audit_path.read_text())["rows"]
        ranked = [[r["layer"], r["kv_head"]] for r in sorted(rows, key=lambda r: r["adapter"])]
    variants = []
    for window in args.windows or [config.window]:
        for top_k in args.top_k or [config.top_k]:
            for count in args.dense_heads or [None]:
                pairs = (config.dense_heads or []) if count is None else sorted(ranked[:count])
                if count and len(pairs) < count:
                    continue
                for mass in (args.probe_mass or [None]) if top_k > 1 else [None]:  # top-1 probes one group
                    variants.append(
                        {
                            "top_k": top_k,
                            "probe_mass": mass,
                            "dense_heads": pairs,
                            "window": window,
                            "dense_below": args.dense_below,
                            "label": variant_label(top_k, window, len(pairs), args.dense_below, probe_mass=mass),
                        }
                    )
    return variants


# --- perplexity ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def block_nll(model, ids: torch.Tensor) -> tuple[float, int, float]:
    """(sum of next-token NLL, tokens scored, seconds of the decoder forward) for one block [seq]."""
    body = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    head = model.get_base_model().lm_head if hasattr(model, "get_base_model") else model.lm_head
    started = time.perf_counter()
    hidden = body(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    seconds = time.perf_counter() - started
    total = 0.0
    for start in range(0, len(ids) - 1, SCORE_CHUNK):
        end = min(start + SCORE_CHUNK, len(ids) - 1)
        logits = head(hidden[start:end]).float()
        total += float(F.cross_entropy(logits, ids[start + 1 : end + 1], reduction="sum"))
    return total, len(ids) - 1, seconds


def focus_density(model, ids: torch.Tensor, window: int, sinks: int) -> float:
    """Share of the causal pairs the hard pattern keeps, averaged over layers and kv heads (dense heads count 1;
    queries with fewer keys than dense_below count all of theirs)."""
    settings = model.peft_config["default"]
    seq = len(ids)
    if seq < settings.dense_below:
        return 1.0  # every query attends densely
    with torch.no_grad(), record_routing(model) as recorder:
        model(input_ids=ids[None], use_cache=False)
    positions = torch.arange(seq)
    causal = positions + 1  # keys of query i
    local = torch.clamp(positions, max=window) + 1 + torch.clamp(positions - window, min=0, max=sinks)
    dense_query = causal < settings.dense_below
    kv_heads = model.config.num_key_value_heads
    dense = {tuple(p) for p in settings.dense_heads or []}
    shares = []
    for index, calls in recorder.routings().items():
        routing = calls[-1]
        own, probes, sink = routing.key_groups[0], routing.top_groups[0], routing.sink[0]
        probed = probed_distant_keys(probes, own, sink, window, settings.num_groups)
        kept = torch.where(dense_query, causal, local + probed)
        for kv in range(kv_heads):
            shares.append(1.0 if (index, kv) in dense else float(kept.sum()) / float(causal.sum()))
    return sum(shares) / len(shares)


def stage_ppl(args) -> None:
    _, heldout = split_texts(load_texts(args.data), heldout_fraction=0.1, seed=0)
    rows = []
    dense, tokenizer = load_dense()
    blocks = token_blocks(tokenizer, heldout, args.seq_len, max_blocks=args.blocks)

    def measure(label, model, extra):
        nll, count, seconds = 0.0, 0, 0.0
        for ids in blocks:
            total, n, s = block_nll(model, ids)
            nll, count, seconds = nll + total, count + n, seconds + s
        row = {"variant": label, "ppl": math.exp(nll / count), "tokens": count, "forward_s": seconds, **extra}
        row.update(seq_len=args.seq_len, data=args.data, blocks=len(blocks), command=command_line(), **machine())
        rows.append(row)
        log(f"{args.data} {args.seq_len}: {label}: PPL {row['ppl']:.4f}")
        append("ppl.json", [row])

    if "dense" in args.parts:
        measure("dense", dense, {"kind": "dense", "density": 1.0})
    kinds = [k for k in ("streaming", "blocks") if k in args.parts or "baselines" in args.parts]
    if kinds:
        dense.config._attn_implementation = baselines.NAME
        for kind in kinds:
            baselines.SETTINGS.update(kind=kind, window=args.window, sinks=args.sinks, density=args.block_density)
            measure(
                f"{kind} (training-free)",
                dense,
                {
                    "kind": kind,
                    "density": baselines.kept_density(args.seq_len),
                    "block_density": args.block_density,
                    "window": args.window,
                },
            )
        dense.config._attn_implementation = "sdpa"
    del dense
    if "focus" not in args.parts:
        return
    model, _ = load_focus(Path(args.adapter))
    config = model.peft_config["default"]
    for variant in focus_variants(model, args):
        apply_variant(model, variant)
        density = focus_density(model, blocks[0], variant["window"], config.sink_tokens)
        measure(variant["label"], model, {"kind": "focus", **variant, "density": density})


def ppl_ratios(rows: list[dict]) -> list[dict]:
    """Each row with `ppl_ratio`: its PPL over the dense PPL measured on the same data, length and blocks."""
    dense = {(r["data"], r["seq_len"], r["blocks"]): r["ppl"] for r in rows if r["kind"] == "dense"}
    return [
        {**r, "ppl_ratio": r["ppl"] / dense[(r["data"], r["seq_len"], r["blocks"])]}
        for r in rows
        if (r["data"], r["seq_len"], r["blocks"]) in dense
    ]


# --- passkey ----------------------------------------------------------------------------------------------------


def stage_passkey(args) -> None:
    rng = random.Random(args.seed)
    depths = [0.1, 0.3, 0.5, 0.7, 0.9]
    cases = [(n, d, str(rng.randrange(10000, 99999))) for n in args.lengths for d in depths for _ in range(args.keys)]
    dense, tokenizer = load_dense()
    prompts = [(n, d, key, passkey_prompt(tokenizer, n, d, key)) for n, d, key in cases]
    results = {"dense": [passkey_answer(dense, tokenizer, ids) for *_, ids in prompts]}
    log(f"dense: {sum(k in a for (_, _, k, _), a in zip(prompts, results['dense']))}/{len(prompts)}")
    del dense
    model, _ = load_focus(Path(args.adapter))
    for variant in focus_variants(model, args):
        apply_variant(model, variant)
        results[variant["label"]] = [passkey_answer(model, tokenizer, ids) for *_, ids in prompts]
        log(f"{variant['label']}: {sum(k in a for (_, _, k, _), a in zip(prompts, results[variant['label']]))}")
    rows = []
    for label, answers in results.items():
        correct = [key in text for (_, _, key, _), text in zip(prompts, answers)]
        dense_correct = [key in text for (_, _, key, _), text in zip(prompts, results["dense"])]
        by_length = {
            str(n): sum(c for (m, *_), c in zip(prompts, correct) if m == n) / (len(depths) * args.keys)
            for n in args.lengths
        }
        kept = sum(c for c, d in zip(correct, dense_correct) if d) / max(sum(dense_correct), 1)
        rows.append(
            {
                "variant": label,
                "accuracy": by_length,
                "overall": sum(correct) / len(correct),
                "answers_kept_of_dense_correct": kept,
                "cases": [
                    {"length": n, "depth": d, "key": k, "answer": a.strip(), "correct": c}
                    for (n, d, k, _), a, c in zip(prompts, answers, correct)
                ],
                "command": command_line(),
                **machine(),
            }
        )
    append("passkey.json", rows)


# --- speed -------------------------------------------------------------------------------------------------------


@torch.no_grad()
def warm_up(model, variants: list[dict], ids: torch.Tensor) -> None:
    """Run every variant once, untimed, on a prompt long enough to be routed and one decoding step after it, so that
    "auto" measures its crossovers (once per machine and shape, `focus_hf.attention.crossover`) before any timed
    call."""
    from transformers import DynamicCache

    for variant in variants:
        apply_variant(model, variant)
        prompt = ids[: variant["dense_below"] + 1024][None]
        output = model(input_ids=prompt, past_key_values=DynamicCache(), use_cache=True)
        model(input_ids=output.logits[:, -1:].argmax(-1), past_key_values=output.past_key_values, use_cache=True)


def stage_speed(args) -> None:
    """Decoder prefill time, dense and every Focus variant alternating at each length (best of --repeats)."""
    _, heldout = split_texts(load_texts("python-source"), heldout_fraction=0.1, seed=0)
    dense, tokenizer = load_dense()
    model, _ = load_focus(Path(args.adapter))
    variants = focus_variants(model, args)
    warm_up(model, variants, token_blocks(tokenizer, heldout, 8192, max_blocks=1)[0])

    def prefill(runner, ids) -> float:
        body = runner.get_base_model().model if hasattr(runner, "get_base_model") else runner.model
        started = time.perf_counter()
        with torch.no_grad():
            body(input_ids=ids[None], use_cache=False)
        return time.perf_counter() - started

    for length in args.lengths:
        ids = token_blocks(tokenizer, heldout, length, max_blocks=1)[0]
        times: dict[str, list[float]] = {"dense": [], **{v["label"]: [] for v in variants}}
        for _ in range(args.repeats):  # dense and Focus alternate, so all see the same machine state
            times["dense"].append(prefill(dense, ids))
            for variant in variants:
                apply_variant(model, variant)
                times[variant["label"]].append(prefill(model, ids))
        dense_s = min(times["dense"])
        rows = []
        for variant in variants:
            focus_s = min(times[variant["label"]])
            rows.append(
                {
                    "seq_len": length,
                    "variant": variant["label"],
                    "dense_s": dense_s,
                    "focus_s": focus_s,
                    "speedup": dense_s / focus_s,
                    "top_k": variant["top_k"],
                    "probe_mass": variant.get("probe_mass"),
                    "window": variant["window"],
                    "dense_heads": len(variant["dense_heads"]),
                    "dense_below": variant["dense_below"],
                    "repeats": args.repeats,
                    "command": command_line(),
                    **machine(),
                }
            )
            log(f"{length}: dense {dense_s:.2f} s, {variant['label']} {focus_s:.2f} s ({dense_s / focus_s:.2f}x)")
        append("speed.json", rows)


def stage_generate(args) -> None:
    """Model-level decoding after a long prompt, dense vs Focus: prefill seconds and greedy decode tokens/s.

    `generate()` itself, timed by `benchmarking.model.timed_generate` (a streamer stamps every new token): the
    prefill up to the first new token, then --new-tokens greedy steps, each model in turn on the same prompt.
    """
    from focus_hf.benchmarking.model import timed_generate

    _, heldout = split_texts(load_texts("python-source"), heldout_fraction=0.1, seed=0)
    dense, tokenizer = load_dense()
    model, _ = load_focus(Path(args.adapter))
    variants = focus_variants(model, args)
    warm_up(model, variants, token_blocks(tokenizer, heldout, 8192, max_blocks=1)[0])

    def timed(runner, ids) -> tuple[float, float]:
        result = timed_generate(runner, ids[None], args.new_tokens + 1, "dynamic")
        return result["prefill_s"], result["tokens_per_s"]

    for length in args.lengths:
        ids = token_blocks(tokenizer, heldout, length, max_blocks=1)[0]
        measured = {"dense": timed(dense, ids)}
        for variant in variants:
            apply_variant(model, variant)
            measured[variant["label"]] = timed(model, ids)
        for label, (prefill, rate) in measured.items():
            log(f"{length}: {label}: prefill {prefill:.2f} s, decode {rate:.2f} tokens/s")
        dense_prefill, dense_rate = measured["dense"]
        append(
            "generate.json",
            [
                {
                    "seq_len": length,
                    "variant": label,
                    "prefill_s": prefill,
                    "decode_tokens_per_s": rate,
                    "dense_prefill_s": dense_prefill,
                    "dense_decode_tokens_per_s": dense_rate,
                    "decode_speedup": rate / dense_rate,
                    "new_tokens": args.new_tokens,
                    "command": command_line(),
                    **machine(),
                }
                for label, (prefill, rate) in measured.items()
                if label != "dense"
            ],
        )


# --- recall audit against the oracles -----------------------------------------------------------------------------


def stage_audit(args) -> None:
    """Attention mass kept by each Focus variant, its group oracle and its key oracle (`focus_hf.audit_recall`),
    on --blocks held-out python-docs blocks of --seq-len tokens: what the routers lose, what better probes could win
    back with these key groups, and what any selector of the same density could keep."""
    from focus_hf.fitting.recall_audit import audit_recall

    _, heldout = split_texts(load_texts(args.data), heldout_fraction=0.1, seed=0)
    model, tokenizer = load_focus(Path(args.adapter))
    blocks = token_blocks(tokenizer, heldout, args.seq_len, max_blocks=args.blocks)
    rows = []
    for variant in focus_variants(model, args):
        apply_variant(model, variant)
        audit = audit_recall(model, list(blocks), queries_per_sequence=256, progress=False)
        means = audit.to_dict()["mean"]
        log(f"{variant['label']}: " + ", ".join(f"{name} {100 * value:.1f}%" for name, value in means.items()))
        rows.append(
            {
                "variant": variant["label"],
                **means,
                "seq_len": args.seq_len,
                "data": args.data,
                "blocks": len(blocks),
                "queries_per_block": 256 + 64,
                "command": command_line(),
                **machine(),
            }
        )
    append("audit.json", rows)


# --- plot + report ---------------------------------------------------------------------------------------------


def stage_plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ppl = ppl_ratios(json.loads((RESULTS / "ppl.json").read_text()))
    rows = [r for r in ppl if r["seq_len"] == args.seq_len and r["data"] == "python-docs"]
    speed = json.loads((RESULTS / "speed.json").read_text()) if (RESULTS / "speed.json").exists() else []
    figure, (axis, right) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [3, 2]})
    top = 1.16  # StreamingLLM-like settings lose far more: drawn at the top edge with their value

    markers = {"dense": "k*", "streaming": "rs", "blocks": "m^", "focus": "bo"}
    adaptive: dict[str, list[dict]] = {}  # adaptive probing: one line per setting, from low to high probe mass
    for row in rows:
        if row.get("probe_mass") is not None:
            setting = f"adaptive (at most {row['top_k']}), w={row['window']}, {len(row['dense_heads'])} dense heads"
            adaptive.setdefault(setting, []).append(row)
            continue
        shown = min(row["ppl_ratio"], top)
        axis.plot(row["density"], shown, markers[row["kind"]], markersize=8)
        off_scale = f" (PPL x{row['ppl_ratio']:.2f}, off scale)" if shown < row["ppl_ratio"] else ""
        axis.annotate(
            baseline_label(row) + off_scale,
            (row["density"], shown),
            fontsize=6,
            xytext=(4, 3),
            textcoords="offset points",
        )
    for setting, points in adaptive.items():
        points.sort(key=lambda r: r["probe_mass"])
        axis.plot([r["density"] for r in points], [r["ppl_ratio"] for r in points], "c.-", markersize=6)
        masses = ", ".join(f"{r['probe_mass']:g}" for r in points)
        axis.annotate(
            f"{setting}, p = {masses}",
            (points[-1]["density"], points[-1]["ppl_ratio"]),
            fontsize=6,
            color="teal",
            xytext=(4, -8),
            textcoords="offset points",
        )
    axis.set_xscale("log")
    axis.set_ylim(0.99, top + 0.01)
    axis.set_xlabel("share of causal attention pairs computed (log)")
    axis.set_ylabel(f"PPL / dense PPL at {args.seq_len} tokens")
    axis.set_title("quality vs attention density (baselines: dense masked, not timed)", fontsize=9)
    measured = {s["variant"]: s["speedup"] for s in speed if s["seq_len"] == args.seq_len}
    for row in rows:
        if row["kind"] == "dense":
            right.plot(1.0, 1.0, "k*", markersize=8)
        elif row["variant"] in measured:
            right.plot(measured[row["variant"]], row["ppl_ratio"], "bo", markersize=7)
            right.annotate(
                row["variant"],
                (measured[row["variant"]], row["ppl_ratio"]),
                fontsize=6,
                xytext=(4, 3),
                textcoords="offset points",
            )
    right.set_xlabel(f"model-level prefill speedup over dense at {args.seq_len} tokens (measured)")
    right.set_title("Focus settings: quality vs measured speed", fontsize=9)
    for panel in (axis, right):
        panel.axhline(1.02, color="grey", linestyle="--", linewidth=0.8)
        panel.text(
            0.99, 1.02, "target 1.02", fontsize=7, ha="right", va="bottom", transform=panel.get_yaxis_transform()
        )
    figure.suptitle(f"SmolLM2-135M-Instruct, python-docs held-out, {args.seq_len} tokens", fontsize=10)
    figure.tight_layout()
    figure.savefig(RESULTS / "tradeoff.png", dpi=120)
    (RESULTS / "tradeoff.json").write_text(
        json.dumps(
            [
                {
                    k: r.get(k)
                    for k in ("variant", "kind", "density", "ppl", "ppl_ratio", "seq_len", "data", "probe_mass")
                }
                for r in rows
            ],
            indent=1,
        )
        + "\n"
    )
    log(f"wrote {RESULTS / 'tradeoff.png'}")
    write_report(ppl, speed)


def baseline_label(row: dict) -> str:
    """A row's variant; a baseline's with its window (from the row, else its command) and block share."""
    if row["kind"] not in ("streaming", "blocks"):
        return row["variant"]
    words = row.get("command", "").split()
    window = row.get("window") or (int(words[words.index("--window") + 1]) if "--window" in words else 128)
    share = f", {row['block_density']:g} of distant blocks" if row["kind"] == "blocks" else ""
    return f"{row['variant']}, w={window}{share}"


def write_report(ppl: list[dict], speed: list[dict]) -> None:
    """results/report.md: every table generated from the JSON files of this folder."""
    lines = [
        "# Lossless long context: results",
        "",
        "Generated by `python benchmarks/long_context/run.py plot` from "
        "the JSON files beside it; each row records the command and machine that produced it.",
        "",
    ]
    lines += [
        "## Perplexity (held-out split; dense = base model without adapter)",
        "",
        "| data | tokens/block | blocks | variant | share of causal pairs | PPL | vs dense |",
        "|---|---|---|---|---|---|---|",
    ]
    shown_dense = set()
    for r in sorted(ppl, key=lambda r: (r["data"], r["seq_len"], r["kind"] != "dense", r["variant"])):
        if r["kind"] == "dense":
            key = (r["data"], r["seq_len"], r["blocks"], round(r["ppl"], 4))
            if key in shown_dense:
                continue  # the same dense figure, measured again by a later run
            shown_dense.add(key)
        lines.append(
            f"| {r['data']} | {r['seq_len']} | {r['blocks']} | {baseline_label(r)} | {r['density']:.3f} | "
            f"{r['ppl']:.3f} | {r['ppl_ratio']:.4f} |"
        )
    passkey_path = RESULTS / "passkey.json"
    if passkey_path.exists():
        passkey = json.loads(passkey_path.read_text())
        lengths = sorted({length for row in passkey for length in row["accuracy"]}, key=int)
        lines += [
            "",
            "## Passkey retrieval (5 depths x keys per length, greedy, 7 new tokens)",
            "",
            "| variant | prompts | " + " | ".join(f"{n} tokens" for n in lengths) + " | overall | dense answers kept |",
            "|---|---|" + "---|" * (len(lengths) + 2),
        ]
        for row in passkey:
            cells = " | ".join(f"{row['accuracy'][n]:.0%}" if n in row["accuracy"] else "-" for n in lengths)
            lines.append(
                f"| {row['variant']} | {len(row['cases'])} | {cells} | {row['overall']:.0%} | "
                f"{row['answers_kept_of_dense_correct']:.0%} |"
            )
    audit_path = RESULTS / "audit.json"
    if audit_path.exists():
        lines += [
            "",
            "## Attention mass kept beyond the window (recall audit, queries beyond the window, mean over kv heads)",
            "",
            "Group oracle: the best probes for these key groups. Key oracle: per query as many distant keys as the "
            "adapter's probes reach, the ones with the most mass for the layer - what any selector of that density "
            "could keep; the gap between the two oracles is what grouping the keys costs.",
            "",
            "| tokens | variant | window + sinks | adapter | group oracle | key oracle |",
            "|---|---|---|---|---|---|",
        ]
        for r in json.loads(audit_path.read_text()):
            lines.append(
                f"| {r['seq_len']} | {r['variant']} | {r['local']:.1%} | {r['adapter']:.1%} | {r['oracle']:.1%} | "
                f"{r['key_oracle']:.1%} |"
            )
    if speed:
        lines += [
            "",
            "## Model-level prefill (decoder forward, dense and Focus alternating, best of repeats)",
            "",
            "| tokens | Focus setting | dense s | Focus s | speedup | threads | load | processor |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in speed:
            lines.append(
                f"| {r['seq_len']} | {r['variant']} | {r['dense_s']:.2f} | {r['focus_s']:.2f} | {r['speedup']:.2f}x | "
                f"{r['threads']} | {r['load_average']:.2f} | {r['cpu']} |"
            )
    generate_path = RESULTS / "generate.json"
    if generate_path.exists():
        lines += [
            "",
            "## Decoding after a long prompt (greedy, KV cache; the loop generate() runs)",
            "",
            "| prompt tokens | Focus setting | new tokens | dense prefill s | Focus prefill s | dense tokens/s | "
            "Focus tokens/s | decode speedup |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in json.loads(generate_path.read_text()):
            lines.append(
                f"| {r['seq_len']} | {r['variant']} | {r['new_tokens']} | {r['dense_prefill_s']:.2f} | "
                f"{r['prefill_s']:.2f} | {r['dense_decode_tokens_per_s']:.2f} | {r['decode_tokens_per_s']:.2f} | "
                f"{r['decode_speedup']:.2f}x |"
            )
    lines += ["", "![trade-off](tradeoff.png)", ""]
    (RESULTS / "report.md").write_text("\n".join(lines))
    log(f"wrote {RESULTS / 'report.md'}")


def main() -> None:
    global RESULTS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", required=True)
    for name in ("ppl", "passkey", "speed", "generate", "audit", "plot"):
        stage = sub.add_parser(name)
        stage.add_argument("--adapter", default=str(ADAPTER))
        stage.add_argument("--top-k", type=int, nargs="+", default=None, help="sweep: Focus top-k values")
        stage.add_argument(
            "--dense-heads", type=int, nargs="+", default=None, help="sweep: numbers of dense heads (audit order)"
        )
        stage.add_argument("--dense-below", type=int, default=0, help="sweep: dense_below of every swept variant")
        stage.add_argument(
            "--probe-mass", type=float, nargs="+", default=None, help="sweep: adaptive probing masses (top-k caps)"
        )
        stage.add_argument("--seq-len", type=int, default=8192)
        stage.add_argument("--blocks", type=int, default=2)
        stage.add_argument("--data", default="python-docs")
        stage.add_argument("--window", type=int, default=128, help="window of the training-free baselines")
        stage.add_argument("--windows", type=int, nargs="+", default=None, help="sweep: Focus windows")
        stage.add_argument("--sinks", type=int, default=4)
        stage.add_argument("--block-density", type=float, default=0.125)
        stage.add_argument(
            "--parts",
            nargs="+",
            default=["dense", "baselines", "focus"],
            help="ppl: dense, baselines (or streaming / blocks), focus",
        )
        stage.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
        stage.add_argument("--keys", type=int, default=2)
        stage.add_argument("--seed", type=int, default=0)
        stage.add_argument("--repeats", type=int, default=1)
        stage.add_argument("--new-tokens", type=int, default=64, help="generate: decoded tokens timed")
        stage.add_argument("--results", type=Path, default=RESULTS, help="folder of the JSON results")
    args = parser.parse_args()
    RESULTS = args.results
    stages = {"ppl": stage_ppl, "passkey": stage_passkey, "speed": stage_speed, "generate": stage_generate}
    stages["audit"] = stage_audit
    {**stages, "plot": stage_plot}[args.stage](args)


if __name__ == "__main__":
    main()
