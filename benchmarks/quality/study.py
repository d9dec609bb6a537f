"""Quality study of Focus on SmolLM2-135M-Instruct and held-out Python reference text (issue 4).

Stages (each writes JSON under --results, default benchmarks/results/quality/; `report` turns them into markdown):

  train     Focus adapters K=4 and K=8 (routers only) and a LoRA r=4 baseline (q_proj + v_proj, ~230K parameters,
            close to Focus K=8's 280K) on the same blocks, steps, learning-rate schedule and seed. Adapters are
            saved under benchmarks/quality/adapters/<name>/ (the K=8 one, smollm2-python-docs-k8, is the headline).
  ppl       held-out perplexity at --seq-len (default 1024): base model; each Focus adapter soft and hard top-1/2/3;
            LoRA; and the untrained (random-router) Focus K=8 for reference.
  kl        KL(base || variant) of next-token distributions on chat prompts shorter than the window ("inside",
            where Focus attends fully by construction) and on long chat prompts ("outside": positions beyond
            the window only).
  passkey   passkey retrieval: a 5-digit key hidden at several depths in filler text, greedy decoding.
  report    benchmarks/results/quality/report.md from the JSON files.

    python benchmarks/quality/study.py train --steps 150
    python benchmarks/quality/study.py ppl kl passkey report

Every number in the report is measured by these scripts on the machine that ran them; nothing is copied from the
paper (its figures are quoted side by side, labelled as such).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model

import focus_hf
from focus_hf.data import load_texts, split_texts, token_blocks
from focus_hf.evaluation import perplexity, routing_mode
from focus_hf.models import DEFAULT_MODEL, load_model_and_tokenizer
from focus_hf.training import train_adapter

HERE = Path(__file__).resolve().parent
ADAPTERS = HERE / "adapters"  # replaced by --adapters
RESULTS = HERE.parent / "results" / "quality"
HEADLINE = "smollm2-python-docs-k8"
FOCUS_ADAPTERS = {"smollm2-python-docs-k4": 4, HEADLINE: 8}
LORA_NAME = "lora-r4-baseline"  # trained for comparison only; not shipped as a Focus adapter
WINDOW = 128
SINKS = 4


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_json(name: str, data: Any, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    log(f"wrote {results / name}")


def corpus(tokenizer, seq_len: int, eval_blocks: int):
    train_texts, heldout_texts = split_texts(load_texts("python-docs"), heldout_fraction=0.1, seed=0)
    return (
        token_blocks(tokenizer, train_texts, seq_len),
        token_blocks(tokenizer, heldout_texts, seq_len, max_blocks=eval_blocks),
        heldout_texts,
    )


# --- train --------------------------------------------------------------------------------------------------------


def stage_train(args) -> None:
    summary = {}
    names = args.only or [*FOCUS_ADAPTERS, LORA_NAME]
    for name in names:
        model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
        train, heldout, _ = corpus(tokenizer, args.seq_len, 1)
        torch.manual_seed(args.seed)
        if name == LORA_NAME:
            config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
            out = RESULTS / "lora-r4"  # a baseline, kept out of the shipped adapters
        else:
            config = focus_hf.FocusConfig(num_groups=FOCUS_ADAPTERS[name], group_dim=16, window=WINDOW, top_k=2, sink_tokens=SINKS)
            out = ADAPTERS / name
        model = get_peft_model(model, config)
        log(f"training {name}: {sum(p.numel() for p in model.parameters() if p.requires_grad):,} parameters, {args.steps} steps of {args.seq_len} tokens, lr {args.lr if name != LORA_NAME else args.lora_lr}")
        result = train_adapter(
            model, train, out, steps=args.steps, lr=args.lr if name != LORA_NAME else args.lora_lr, seed=args.seed,
            save_steps=args.steps, logging_steps=5, balance_blocks=heldout if name != LORA_NAME else None,
            base_model_name_or_path=DEFAULT_MODEL, progress_bar=not args.no_progress,
            extra_metadata={"data": "python-docs", "heldout_fraction": 0.1, "split_seed": 0, "command": "benchmarks/quality/study.py train"},
        )
        from focus_hf.training import remove_checkpoints

        remove_checkpoints(out)
        summary[name] = {k: result[k] for k in ("steps", "seq_len", "lr", "tokens_seen", "wall_time_s", "final_loss", "trainable_parameters")}
        summary[name]["folder"] = os.path.relpath(out, HERE.parent.parent)
        summary[name]["max_dominance"] = result["dominance"][-1]["max"] if result.get("dominance") else None
        # Written after every adapter, so an interrupted run keeps the summary of the finished ones.
        previous = _read(args.results / "train.json") or {}
        previous.update(summary)
        write_json("train.json", previous, args.results)


def _read(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.is_file() else None


def load_focus(name: Optional[str]):
    """Base model with the named Focus adapter (None: random routers, K=8)."""
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    if name is None:
        torch.manual_seed(0)
        return get_peft_model(model, focus_hf.FocusConfig(num_groups=8, group_dim=16, window=WINDOW, top_k=2, sink_tokens=SINKS)).eval(), tokenizer
    return PeftModel.from_pretrained(model, ADAPTERS / name).eval(), tokenizer


def load_lora():
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    return PeftModel.from_pretrained(model, RESULTS / "lora-r4").eval(), tokenizer


# --- ppl ----------------------------------------------------------------------------------------------------------


def stage_ppl(args) -> None:
    rows = []
    model, tokenizer = load_focus(None)
    _, heldout, _ = corpus(tokenizer, args.seq_len, args.eval_blocks)
    log(f"perplexity on {heldout.shape[0]} held-out windows of {args.seq_len} tokens")
    rows.append({"variant": "base (full attention)", **perplexity(model, heldout, seq_len=args.seq_len, mode="full")})
    for top_k in (1, 2, 3):
        rows.append({"variant": f"untrained routers K=8, hard top-{top_k}", "K": 8, **perplexity(model, heldout, seq_len=args.seq_len, mode="hard", top_k=top_k)})
    for name, k in FOCUS_ADAPTERS.items():
        if not (ADAPTERS / name).is_dir():
            continue
        model, _ = load_focus(name)
        rows.append({"variant": f"{name} soft", "K": k, **perplexity(model, heldout, seq_len=args.seq_len, mode="soft")})
        for top_k in (1, 2, 3):
            rows.append({"variant": f"{name} hard top-{top_k}", "K": k, **perplexity(model, heldout, seq_len=args.seq_len, mode="hard", top_k=top_k)})
        log(rows[-1])
    if (RESULTS / "lora-r4").is_dir():
        model, _ = load_lora()
        # perplexity(mode="full") would disable the LoRA adapter: score the LoRA model directly on the same windows.
        rows.append({"variant": "LoRA r=4 (q,v)", **_direct_ppl(model, heldout), "seq_len": args.seq_len, "mode": "lora"})
    write_json("ppl.json", {"seq_len": args.seq_len, "windows": int(heldout.shape[0]), "rows": rows}, args.results)


@torch.no_grad()
def _direct_ppl(model, blocks) -> dict:
    nll, count = 0.0, 0
    for block in blocks:
        logits = model(input_ids=block[None], use_cache=False).logits[0, :-1].float()
        nll += F.cross_entropy(logits, block[1:], reduction="sum").item()
        count += block.numel() - 1
    return {"ppl": math.exp(nll / count), "tokens": count}


# --- kl -----------------------------------------------------------------------------------------------------------

SHORT_QUESTIONS = [
    "What does the `yield` keyword do in Python?",
    "Explain the difference between a list and a tuple.",
    "How do I open a file and read it line by line?",
    "What is a decorator?",
    "When should I use a set instead of a list?",
    "What does `if __name__ == '__main__':` mean?",
]


def chat_prompts(tokenizer, heldout_texts: list[str], long_tokens: int) -> dict[str, list[torch.Tensor]]:
    def encode(content: str) -> torch.Tensor:
        messages = [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])

    inside = [encode(question) for question in SHORT_QUESTIONS]
    passages = [text for text in heldout_texts if len(tokenizer(text, verbose=False)["input_ids"]) > long_tokens][: len(SHORT_QUESTIONS)]
    outside = []
    for passage, question in zip(passages, SHORT_QUESTIONS):
        ids = tokenizer(passage)["input_ids"][:long_tokens]
        outside.append(encode(f"Read this documentation:\n\n{tokenizer.decode(ids)}\n\nUsing it, answer: {question}"))
    return {"inside": inside, "outside": outside}


@torch.no_grad()
def _log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(input_ids=ids[None], use_cache=False).logits[0].float(), dim=-1)


def stage_kl(args) -> None:
    base, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    _, _, heldout_texts = corpus(tokenizer, 256, 1)
    prompts = chat_prompts(tokenizer, heldout_texts, args.kl_tokens)
    reference = {kind: [_log_probs(base, ids) for ids in items] for kind, items in prompts.items()}
    lengths = {kind: [int(ids.numel()) for ids in items] for kind, items in prompts.items()}
    log(f"KL prompts: {lengths}")
    variants = []
    if (ADAPTERS / HEADLINE).is_dir():
        model, _ = load_focus(HEADLINE)
        for top_k in (1, 2):
            variants.append((f"{HEADLINE} hard top-{top_k}", model, top_k))
    if (RESULTS / "lora-r4").is_dir():
        lora, _ = load_lora()
        variants.append(("LoRA r=4 (q,v)", lora, None))
    rows = []
    for label, model, top_k in variants:
        row = {"variant": label}
        for kind, items in prompts.items():
            values = []
            for ids, ref in zip(items, reference[kind]):
                if top_k is not None:
                    with routing_mode(model, "hard", top_k):
                        lp = _log_probs(model, ids)
                else:
                    lp = _log_probs(model, ids)
                kl = (ref.exp() * (ref - lp)).sum(-1)  # KL(base || variant) per position
                positions = kl if kind == "inside" else kl[WINDOW + 1 :]
                values.append(positions.mean().item())
            row[f"kl_{kind}"] = sum(values) / len(values)
            row[f"kl_{kind}_max_prompt"] = max(values)
        rows.append(row)
        log(row)
    write_json("kl.json", {"window": WINDOW, "prompt_tokens": lengths, "rows": rows}, args.results)


# --- passkey ------------------------------------------------------------------------------------------------------

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompt(tokenizer, length: int, depth: float, key: str) -> torch.Tensor:
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = " What is the pass key? The pass key is"
    budget = length - len(tokenizer(needle + question)["input_ids"]) - 2
    filler_ids = tokenizer(FILLER * (budget // 10 + 10))["input_ids"][:budget]
    cut = int(len(filler_ids) * depth)
    text = tokenizer.decode(filler_ids[:cut]) + needle + tokenizer.decode(filler_ids[cut:]) + question
    return torch.tensor(tokenizer(text)["input_ids"])


@torch.no_grad()
def _answer(model, tokenizer, ids: torch.Tensor) -> str:
    output = model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=7, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, ids.numel():], skip_special_tokens=True)


def stage_passkey(args) -> None:
    rng = random.Random(0)
    base, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    cases = [(length, depth, f"{rng.randrange(10000, 99999)}") for length in args.passkey_lengths for depth in (0.1, 0.3, 0.5, 0.7, 0.9)]
    variants = [("base (full attention)", base, None)]
    if (ADAPTERS / HEADLINE).is_dir():
        model, _ = load_focus(HEADLINE)
        variants += [(f"{HEADLINE} hard top-{k}", model, k) for k in (1, 2)]
    rows = []
    for label, model, top_k in variants:
        hits = {}
        for length, depth, key in cases:
            ids = passkey_prompt(tokenizer, length, depth, key)
            if top_k is None:
                answer = _answer(model, tokenizer, ids)
            else:
                with routing_mode(model, "hard", top_k):
                    answer = _answer(model, tokenizer, ids)
            hits.setdefault(str(length), []).append({"depth": depth, "key": key, "answer": answer.strip(), "correct": key in answer})
        row = {"variant": label, "accuracy": {length: sum(h["correct"] for h in items) / len(items) for length, items in hits.items()}, "cases": hits}
        rows.append(row)
        log({"variant": label, "accuracy": row["accuracy"]})
    write_json("passkey.json", {"lengths": args.passkey_lengths, "depths": [0.1, 0.3, 0.5, 0.7, 0.9], "rows": rows}, args.results)


# --- report -------------------------------------------------------------------------------------------------------


def stage_report(args) -> None:
    lines = ["# Focus quality study: SmolLM2-135M-Instruct on held-out Python reference text", ""]
    lines.append("All figures measured by `benchmarks/quality/study.py` on a 2-core CPU; paper figures are GPT-2 / 7B "
                 "models and are quoted only for orientation.")
    train = _read(args.results / "train.json")
    if train:
        lines += ["", "## Training", "", "| adapter | params | steps x tokens | lr | wall time | final loss | max dominance |", "|---|---|---|---|---|---|---|"]
        for name, row in train.items():
            dom = row.get("max_dominance")
            lines.append(f"| {name} | {row['trainable_parameters']:,} | {row['steps']} x {row['seq_len']} | {row['lr']} | {row['wall_time_s']:.0f} s | {row['final_loss']:.3f} | {'' if dom is None else f'{dom:.2f}'} |")
    ppl = _read(args.results / "ppl.json")
    if ppl:
        full = next(r["ppl"] for r in ppl["rows"] if r["variant"].startswith("base"))
        lines += ["", f"## Held-out perplexity ({ppl['windows']} windows of {ppl['seq_len']} tokens, window w={WINDOW}, {SINKS} sinks)", "",
                  "| variant | PPL | vs base |", "|---|---|---|"]
        for row in ppl["rows"]:
            lines.append(f"| {row['variant']} | {row['ppl']:.3f} | {(row['ppl'] / full - 1) * 100:+.2f}% |")
    kl = _read(args.results / "kl.json")
    if kl:
        lines += ["", f"## KL(base || variant) of next-token distributions on chat prompts", "",
                  f"inside: prompts of {kl['prompt_tokens']['inside']} tokens (shorter than the window); outside: prompts of "
                  f"{kl['prompt_tokens']['outside']} tokens, positions beyond the window only.", "",
                  "| variant | mean KL inside | mean KL outside |", "|---|---|---|"]
        for row in kl["rows"]:
            lines.append(f"| {row['variant']} | {row['kl_inside']:.3g} | {row['kl_outside']:.3g} |")
    passkey = _read(args.results / "passkey.json")
    if passkey:
        lengths = [str(length) for length in passkey["lengths"]]
        lines += ["", "## Passkey retrieval (5 depths per length, greedy)", "", "| variant | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        for row in passkey["rows"]:
            lines.append(f"| {row['variant']} | " + " | ".join(f"{row['accuracy'].get(n, float('nan')):.0%}" for n in lengths) + " |")
    path = args.results / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    log(f"wrote {path}")


STAGES = {"train": stage_train, "ppl": stage_ppl, "kl": stage_kl, "passkey": stage_passkey, "report": stage_report}


def main(argv=None) -> int:
    global ADAPTERS, RESULTS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stages", nargs="+", choices=sorted(STAGES))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=5e-3, help="Focus router learning rate")
    parser.add_argument("--lora-lr", type=float, default=1e-4, help="LoRA learning rate (the paper's middle value: 1e-5/5e-5/1e-4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="train only these adapters")
    parser.add_argument("--eval-blocks", type=int, default=16)
    parser.add_argument("--kl-tokens", type=int, default=600, help="passage tokens of the 'outside' prompts")
    parser.add_argument("--passkey-lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--adapters", type=Path, default=ADAPTERS, help="where Focus adapters are written / read")
    args = parser.parse_args(argv)
    ADAPTERS, RESULTS = args.adapters, args.results
    for stage in args.stages:
        started = time.perf_counter()
        STAGES[stage](args)
        log(f"stage {stage} done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
