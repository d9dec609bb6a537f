"""Turn the committed speed measurements into benchmarks/results/speed.md and a speedup-vs-length PNG.

    python benchmarks/speed_report.py

Reads (whichever exist) under benchmarks/results/:
  attention_cpu.json              `focus-hf bench --json` rows (attention level, dense vs Focus, same run)
  attention_cpu_query_router.json the same with `--query-router` (queries routed by a separate projection)
  attention_cpu_peak_memory.json  `focus-hf bench --peak-memory --json` rows (dense SDPA and Focus)
  attention_cpu_auto_K*.json      `focus-hf bench --groups K --top-k 1 2 3 4 --json` rows (backend auto, per K)
  attention_cpu_decode.json       `focus-hf bench --decode --json` rows (one new token against a KV cache)
  model_prefill*.json             `python benchmarks/model/prefill.py --json` rows (SmolLM2 end to end)
  model_decode*.json              `python benchmarks/model/generate.py --json` rows (SmolLM2 generate() after a prompt)
  model_steps*.json               `python benchmarks/model/decode_steps.py --json` rows (decoding steps, in turn)
  arithmetic_ceiling.json         `python benchmarks/cpu/arithmetic_ceiling.py --json` rows (GEMM rate, attention calls)
and writes speed.md (tables + the commands recorded in the rows) and attention_speedup.png (needs matplotlib:
`pip install 'focus-hf[bench]'`). Nothing here is measured or typed in by hand: every figure comes from the JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

RESULTS = Path(__file__).resolve().parent / "results"
PLOT = "attention_speedup.png"
# The paper's H100 top-1 speedups (K=8, vs FlashAttention), quoted for orientation only: other hardware and kernels.
PAPER_H100_TOP1 = {1024: 0.2, 4096: 0.6, 16384: 1.8, 32768: 3.1, 65536: 4.7, 262144: 7.6, 1048576: 8.6}


def read(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else []


def commands(rows: list[dict[str, Any]]) -> list[str]:
    seen = []
    for row in rows:
        if row.get("command") and row["command"] not in seen:
            seen.append(row["command"])
    return seen


def plot(rows: list[dict[str, Any]], path: Path) -> Optional[Path]:
    """Measured speedup (solid) and ideal speedup (dashed, causal pairs / allowed pairs) per top_k."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'focus-hf[bench]')")
        return None
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for top_k in sorted({row["top_k"] for row in rows}):
        mine = sorted((row for row in rows if row["top_k"] == top_k), key=lambda row: row["seq_len"])
        timed = [row for row in mine if row["speedup"] is not None]
        line = axis.plot(
            [r["seq_len"] for r in timed], [r["speedup"] for r in timed], marker="o", label=f"top-{top_k} measured"
        )
        axis.plot(
            [r["seq_len"] for r in mine],
            [r["ideal_speedup"] for r in mine],
            linestyle="--",
            color=line[0].get_color(),
            alpha=0.5,
            label=f"top-{top_k} ideal",
        )
        for row in timed:
            axis.annotate(
                f"{row['speedup']:.2f}x",
                (row["seq_len"], row["speedup"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
    longest = max(row["seq_len"] for row in rows)
    paper = sorted((n, x) for n, x in PAPER_H100_TOP1.items() if n <= longest)
    axis.plot(
        [n for n, _ in paper],
        [x for _, x in paper],
        marker="x",
        linestyle=":",
        color="gray",
        label="paper, H100, top-1 (quoted)",
    )
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log", base=2)
    axis.set_xlabel("sequence length (tokens)")
    axis.set_ylabel("speedup over dense causal SDPA")
    first = rows[0]
    axis.set_title(
        f"Focus hard attention (one layer), K={first['groups']}, w={first['window']}, {first['sinks']} sinks, "
        f"{first['heads']}x{first['head_dim']} heads / {first['kv_heads']} kv, {first['dtype']}\n"
        f"{first['device']}, backend {first['backend']}, torch {first['torch']}",
        fontsize=8,
    )
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3, which="both")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def attention_section(rows: list[dict[str, Any]], memory: list[dict[str, Any]]) -> list[str]:
    lines = ["## Attention level (one layer, random q/k/v, routing from a random router, balanced groups)", ""]
    if (RESULTS / PLOT).is_file():
        lines += [f"![speedup vs length]({PLOT})", ""]
    lines += [
        "| routing | tokens | top_k | dense s | Focus s | speedup | ideal | efficiency | allowed pairs "
        "| CPU-time speedup | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda row: (bool(row.get("query_router")), row["top_k"], row["seq_len"])):
        dense = "-" if row["dense_s"] is None else f"{row['dense_s']:.4f}"
        speedup = "-" if row["speedup"] is None else f"**{row['speedup']:.2f}x**"
        cpu = "-" if row["cpu_speedup"] is None else f"{row['cpu_speedup']:.2f}x"
        efficiency = "-" if row["speedup"] is None else f"{row['speedup'] / row['ideal_speedup']:.2f}"
        routing = "query router" if row.get("query_router") else "own group"
        lines.append(
            f"| {routing} | {row['seq_len']:,} | {row['top_k']} | {dense} | {row['focus_s']:.4f} | {speedup} | "
            f"{row['ideal_speedup']:.2f}x | {efficiency} | {row['pairs_fraction']:.1%} | {cpu} | "
            f"{row['load_avg_1m']:.2f} |"
        )
    lines += [
        "",
        "Median of the repetitions in the row's JSON (`repeats`); dense and Focus are timed alternately in the same "
        "loop. Efficiency: speedup / ideal, the ideal being causal pairs / allowed pairs (a kernel as fast per pair as "
        "dense SDPA's that computes only the allowed pairs). Routing: queries probe their own key group first (own "
        "group: each entry reaches one key more than the one before) or the groups a separate query projection picks "
        "(query router, as in adapters trained with `query_projection=True`: entries skip keys of their segment). On "
        "CPU in float32 and bfloat16 the own-group pass is one call of the C prefill kernel per block of 16K queries "
        "either way, each entry reading its segment's keys up to its reach; elsewhere it goes in chunks, causal "
        "squares or masked staircases.",
    ]
    if memory:
        lines += [
            "",
            "Peak resident memory of one forward, dense causal SDPA against Focus on the same inputs (each call in a "
            "fresh process, q/k/v included; where the row says so, the process's peak was reset just before the call, "
            "so that building the inputs does not count"
            + (
                f", after a warm-up call of {memory[0]['warm_up_tokens']:,} tokens on the same path, so that library "
                "code paged in on first use does not count either"
                if memory[0].get("warm_up_tokens")
                else ""
            )
            + "):",
            "",
            "| tokens | variant | top_k | RSS before the call | peak RSS | added by the call | vs dense | peak reset |",
            "|---|---|---|---|---|---|---|---|",
        ]
        dense_added = {
            row["seq_len"]: row["peak_rss_mib"] - row["rss_before_call_mib"]
            for row in memory
            if row.get("variant") == "dense SDPA"
        }
        for row in memory:
            added = row["peak_rss_mib"] - row["rss_before_call_mib"]
            baseline = dense_added.get(row["seq_len"])
            ratio = f"{added / baseline:.2f}x" if baseline else "-"
            reset = {True: "yes", False: "no"}.get(row.get("peak_reset_before_call"), "-")
            lines.append(
                f"| {row['seq_len']:,} | {row.get('variant', 'Focus')} | {row['top_k'] or '-'} | "
                f"{row['rss_before_call_mib']:.0f} MiB | {row['peak_rss_mib']:.0f} MiB | {added:.0f} MiB | {ratio} | "
                f"{reset} |"
            )
    return lines


def auto_section(rows: list[dict[str, Any]], floor: float = 0.95) -> list[str]:
    """Speedup of backend "auto" over dense SDPA per (K, top_k) and length: the "never slower than dense" check."""
    lengths = sorted({row["seq_len"] for row in rows})
    configs = sorted({(row["groups"], row["top_k"]) for row in rows})
    cell = {(row["groups"], row["top_k"], row["seq_len"]): row for row in rows}
    first = rows[0]
    held = sum(row["speedup"] >= floor for row in rows)
    lines = [
        f"## Backend auto against dense SDPA, K x top_k x length (cells below {floor:.2f}x in bold)",
        "",
        f"w={first['window']}, {first['sinks']} sinks, {first['heads']}x{first['head_dim']} heads / "
        f"{first['kv_heads']} kv, {first['dtype']}, {first['processor']}, {first['threads']} threads; each cell is "
        "Focus's median time against dense's in the same loop. `auto` runs the exact pattern as one dense masked call "
        "below its measured crossover (`dense_below`, last column; on CPU in float32 the C prefill kernel, reading the "
        "pattern from group bits) and the sparse path above; with every group probed it runs one plain causal call. "
        f"{held} of {len(rows)} cells reach {floor:.2f}x.",
        "",
        "| K | top_k | " + " | ".join(f"{n:,}" for n in lengths) + " | dense_below |",
        "|---|---|" + "---|" * (len(lengths) + 1),
    ]
    for groups, top_k in configs:
        cells = []
        for n in lengths:
            row = cell.get((groups, top_k, n))
            if row is None:
                cells.append("-")
                continue
            text = f"{row['speedup']:.2f}x"
            cells.append(text if row["speedup"] >= floor else f"**{text}**")
        crossover = cell.get((groups, top_k, lengths[0]), {}).get("dense_below")
        lines.append(f"| {groups} | {top_k} | " + " | ".join(cells) + f" | {crossover if crossover else '-'} |")
    return lines


def decode_section(rows: list[dict[str, Any]]) -> list[str]:
    first = rows[0]
    lines = [
        "## Decoding (one new query against a KV cache of each length, one layer)",
        "",
        f"K={first['groups']}, w={first['window']}, {first['sinks']} sinks, "
        f"{first['heads']}x{first['head_dim']} heads / {first['kv_heads']} kv, {first['dtype']}, {first['processor']}, "
        f"{first['threads']} threads, backend {first['backend']}; median of {first['repeats']} alternating "
        "repetitions; a step's attention in "
        f"{'the C kernel (attention/cpu/native.py)' if first.get('decode_kernel') == 'C' else 'torch operations'}.",
        "",
        "| cache tokens | top_k | dense ms | Focus ms | speedup | ideal (keys read) | Focus path | load avg |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda row: (row["top_k"], row["cache_len"])):
        lines.append(
            f"| {row['cache_len']:,} | {row['top_k']} | {row['dense_s'] * 1e3:.3f} | {row['focus_s'] * 1e3:.3f} | "
            f"**{row['speedup']:.2f}x** | {row['ideal_speedup']:.2f}x | {row['focus_path']} | "
            f"{row['load_avg_1m']:.2f} |"
        )
    return lines


def ceiling_section(rows: list[dict[str, Any]]) -> list[str]:
    first = rows[0]
    lines = [
        "## Arithmetic ceiling (how fast this CPU multiplies, and how close attention calls come to it)",
        "",
        f"{first['processor']}, {first['threads']} threads, float32, one process; useful GFLOP/s = 4 x head_dim flops "
        "per visible query-key pair and head (q.k and p.v) / median time. The efficiency targets compare Focus with "
        "dense SDPA's rate per pair: where dense already runs near the GEMM rate, Focus's short calls (one group's "
        "queries, the local blocks) cannot run faster per pair than the kernel runs them here.",
        "",
        "| call | shape | ms | useful GFLOP/s | of the GEMM rate | ns per pair and head | load avg |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        per_pair = "-" if row["ns_per_pair_head"] is None else f"{row['ns_per_pair_head']:.2f}"
        lines.append(
            f"| {row['call']} | {row['shape']} | {row['ms']:.2f} | {row['gflops']:.0f} | "
            f"**{row['fraction_of_gemm']:.0%}** | {per_pair} | {row['load_avg_1m']:.2f} |"
        )
    return lines


def model_section(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Model level: SmolLM2-135M-Instruct prefill, same text for every variant",
        "",
        "| tokens | variant | decoder forward s | speedup vs full | PPL | PPL vs full | load avg |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['seq_len']:,} | {row['variant']} | {row['seconds']:.1f} | **{row['speedup']:.2f}x** | "
            f"{row['ppl']:.3f} | {(row['ppl_vs_full'] - 1) * 100:+.2f}% | {row['load_avg_1m']:.2f} |"
        )
    first = rows[0]
    beyond = sorted({row["seq_len"] for row in rows if row["seq_len"] > row.get("model_max_positions", row["seq_len"])})
    if beyond:
        lines += [
            "",
            f"At {', '.join(f'{n:,}' for n in beyond)} tokens the text is longer than the model's "
            f"{first['model_max_positions']:,} trained positions: the perplexity of every variant there (full "
            "attention included) says the model is out of its depth, and only the timing is meaningful.",
        ]
    lines += [
        "",
        f"Adapter `{first['adapter']}`, backend {first['backend'] if first['top_k'] else rows[-1]['backend']}, text: "
        f"{first['text']}; {first['threads']} threads, {first['device']}, torch {first['torch']}. One timed run per "
        "variant (`repeats`).",
    ]
    return lines


def model_decode_section(rows: list[dict[str, Any]]) -> list[str]:
    first = rows[0]
    lines = [
        "## Model level: SmolLM2-135M-Instruct `generate()` after a long prompt",
        "",
        f"Greedy, {first['new_tokens']} new tokens; decoding speed from the second new token on (the prefill is "
        "timed apart). Quality at the same setting: Focus's generation is teacher-forced on full attention's tokens "
        "and each step's next-token distribution is compared with full attention's (argmax agreement, KL in nats).",
        "",
        "| prompt tokens | KV cache | variant | prefill s | tokens/s | ms per token | speedup vs full "
        "| argmax agrees | mean KL | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['prompt_len']:,} | {row['cache']} | {row['variant']} | {row['prefill_s']:.1f} | "
            f"{row['decode_tokens_per_s']:.2f} | {row['decode_step_ms']:.0f} | **{row['speedup']:.2f}x** | "
            f"{row['argmax_agree']} / {row['new_tokens']} | {row['mean_kl']:.4f} | {row['load_avg_1m']:.2f} |"
        )
    beyond = sorted({row["prompt_len"] for row in rows if row["prompt_len"] > row["model_max_positions"]})
    if beyond:
        lines += [
            "",
            f"After {', '.join(f'{n:,}' for n in beyond)}-token prompts the model runs past its "
            f"{first['model_max_positions']:,} trained positions (full attention included, see the prefill "
            "perplexities above): the two variants then disagree as two out-of-range models may, and only the "
            "timing is meaningful.",
        ]
    lines += [
        "",
        f"Adapter `{first['adapter']}`, text: {first['text']}; {first['processor']}, {first['threads']} threads, torch "
        f"{first['torch']}. Best of {first['repeats']} generation(s) per variant. With the default DynamicCache every "
        "step copies the whole cache (one concatenation per layer), which both variants pay; a static cache "
        '(`cache_implementation="static"`) leaves the weights and the attention.',
    ]
    return lines


def model_steps_section(rows: list[dict[str, Any]]) -> list[str]:
    first = rows[0]
    lines = [
        "## Model level: SmolLM2-135M-Instruct decoding steps, the two variants stepped in turn",
        "",
        "| prompt tokens | KV cache | variant | median ms per step | speedup vs full | steps | load avg |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['prompt_len']:,} | {row['cache']} | {row['variant']} | {row['step_ms']:.1f} | "
            f"**{row['speedup']:.2f}x** | {row['steps']} | {row['load_avg_1m']:.2f} |"
        )
    lines += [
        "",
        f"Adapter `{first['adapter']}`; {first['processor']}, {first['threads']} threads, torch {first['torch']}. Each "
        "variant reads the prompt into a cache of its own, then one decoding step of full attention and one of Focus "
        "alternate, so that both see the same machine from moment to moment (whole generate() calls, above, run one "
        "after the other).",
    ]
    return lines


def main() -> int:
    own_group = read(RESULTS / "attention_cpu.json")
    attention = own_group + read(RESULTS / "attention_cpu_query_router.json")
    memory = read(RESULTS / "attention_cpu_peak_memory.json")
    decode = read(RESULTS / "attention_cpu_decode.json")
    auto = [row for path in sorted(RESULTS.glob("attention_cpu_auto_K*.json")) for row in read(path)]
    model = sorted(
        (row for path in RESULTS.glob("model_prefill*.json") for row in read(path)), key=lambda row: row["seq_len"]
    )
    generation = sorted(
        (row for path in RESULTS.glob("model_decode*.json") for row in read(path)),
        key=lambda row: (row["prompt_len"], row["cache"]),
    )
    steps = sorted(
        (row for path in RESULTS.glob("model_steps*.json") for row in read(path)),
        key=lambda row: (row["prompt_len"], row["cache"]),
    )
    ceiling = read(RESULTS / "arithmetic_ceiling.json")
    lines = [
        "# Speed of Focus hard mode on this CPU",
        "",
        "Generated by `python benchmarks/speed_report.py` from the JSON files next to this page; every figure is "
        "a measurement from one run of the commands below (dense and Focus in the same process).",
        "",
    ]
    if attention:
        plot(own_group, RESULTS / PLOT)
        lines += attention_section(attention, memory) + [""]
    if ceiling:
        lines += ceiling_section(ceiling) + [""]
    if auto:
        lines += auto_section(auto) + [""]
    if decode:
        lines += decode_section(decode) + [""]
    if model:
        lines += model_section(model) + [""]
    if generation:
        lines += model_decode_section(generation) + [""]
    if steps:
        lines += model_steps_section(steps) + [""]
    lines += ["## Commands", "", "```"] + commands(
        attention + memory + ceiling + auto + decode + model + generation + steps
    )
    lines += ["```", ""]
    (RESULTS / "speed.md").write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {RESULTS / 'speed.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
