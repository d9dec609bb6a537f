"""Serving under load: concurrent greedy requests get exactly the tokens each gets alone, with no error and no
dropped request - on vLLM's OpenAI server (CPU engine) with a Focus adapter, and in a plain transformers app whose
threads share one model. Throughput against the same server with vLLM's own attention, and against the same app
with the adapter disabled, in the same run.

vLLM: one server per variant (Focus: `--additional-config '{"focus_adapter": ...}'`; dense: vLLM's own CPU
attention), eager (the Focus plugin runs the model eagerly; the dense server is run the same way, so that only the
attention differs), float32, prefix caching off (every request reads its whole prompt, alone or not). Each server
first answers every request alone, one after another (the reference), then --clients streaming clients send them all
at once, each taking the next request from a shared queue (mixed lengths interleaved). A response is dropped when it
ends without its --new-tokens tokens (ignore_eos: every request decodes exactly as many); it is unequal when its
token ids differ from the request's alone.

transformers: one model (SmolLM2 with the adapter, hard routing), `generate()` greedy for every request alone, then
--threads threads at once on the same model, each taking the next request from a queue; torch runs one thread per
calling thread (several threads each running torch's pool over the same cores only wait for one another). The same
with the adapter disabled, for the throughput of the model's own attention.

    .venv-vllm/bin/python benchmarks/serving_stress.py --json benchmarks/results/serving_stress.json

Prompts: held-out Python source (`python-source`), --requests lengths spread evenly in log scale from --min-prompt to
--max-prompt tokens. Wall-clock figures on a shared CPU vary: the load average around each pass is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, Optional

from vllm_serving import ADAPTER, _prompts  # this script's folder

ROOT = Path(__file__).resolve().parents[2]


def prompt_lengths(count: int, shortest: int, longest: int) -> list[int]:
    """`count` lengths spread evenly in log scale from `shortest` to `longest` tokens."""
    if count == 1:
        return [longest]
    ratio = (longest / shortest) ** (1 / (count - 1))
    return [round(shortest * ratio**index) for index in range(count)]


def arrival_order(count: int) -> list[int]:
    """The order in which concurrent clients take the requests: shuffled (fixed seed), so that long and short
    requests run side by side."""
    order = list(range(count))
    random.Random(0).shuffle(order)
    return order


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def run_concurrently(count: int, workers: int, handle: Callable[[int], dict]) -> tuple[list[Optional[dict]], float]:
    """`handle(index)` for every request index, by `workers` threads that each take the next index from a queue (in
    `arrival_order`); the results by index (an exception is recorded as {"error": ...}) and the wall time."""
    pending: queue.Queue = queue.Queue()
    for index in arrival_order(count):
        pending.put(index)
    results: list[Optional[dict]] = [None] * count

    def worker() -> None:
        while True:
            try:
                index = pending.get_nowait()
            except queue.Empty:
                return
            try:
                results[index] = handle(index)
            except Exception as error:  # counted as the request's error, the others go on
                results[index] = {"error": f"{type(error).__name__}: {error}"}

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - started


def pass_summary(prompts: list[list[int]], results: list[Optional[dict]], wall: float, new_tokens: int) -> dict:
    """Requests, errors, dropped responses and throughput of one pass."""
    errors = [(r or {"error": "no result"})["error"] for r in results if r is None or "error" in r]
    complete = [r for r in results if r is not None and "error" not in r and len(r["tokens"]) == new_tokens]
    generated = sum(len(r["tokens"]) for r in results if r is not None and "error" not in r)
    return {
        "requests": len(prompts),
        "errors": len(errors),
        "error_messages": errors[:5],
        "dropped": len(prompts) - len(complete) - len(errors),
        "wall_s": round(wall, 2),
        "generated_tokens": generated,
        "generated_tokens_per_s": round(generated / wall, 3),
        "prompt_and_generated_tokens_per_s": round((sum(map(len, prompts)) + generated) / wall, 2),
        "mean_ttft_s": _mean([r["ttft_s"] for r in complete if r.get("ttft_s") is not None]),
    }


def _mean(values: list[float]) -> Optional[float]:
    return round(sum(values) / len(values), 3) if values else None


def compare(alone: list[Optional[dict]], together: list[Optional[dict]]) -> dict:
    """How many concurrent responses equal the request's alone, and where the others first differ."""
    unequal = []
    for index, (want, got) in enumerate(zip(alone, together)):
        if want is None or got is None or "error" in want or "error" in got or want["tokens"] != got["tokens"]:
            first = None
            if want and got and "tokens" in want and "tokens" in got:
                first = next((i for i, (a, b) in enumerate(zip(want["tokens"], got["tokens"])) if a != b), None)
            unequal.append({"request": index, "first_different_token": first})
    return {"equal_to_alone": len(alone) - len(unequal), "unequal": unequal}


# --- vLLM's OpenAI server -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def openai_server(model: Path, adapter: Optional[Path], max_len: int, log: Path, env: dict) -> Iterator[str]:
    """vLLM's OpenAI server on 127.0.0.1 (with the Focus adapter, or vLLM's own attention where `adapter` is None);
    its base URL while it runs."""
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "served", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(max_len), "--enforce-eager", "--no-enable-prefix-caching",
        "--gpu-memory-utilization", "0.3", "--seed", "0",
    ]  # fmt: skip
    if adapter is not None:
        command += ["--additional-config", json.dumps({"focus_adapter": str(adapter)})]
    with open(log, "w") as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        try:
            wait_until_up(server, f"http://127.0.0.1:{port}/health", log, timeout=900)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            server.terminate()
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def wait_until_up(process: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Wait until the server started as `process` answers `url` with 200; RuntimeError (with the end of its `log`)
    where it exits or does not answer within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"the server did not answer {url} within {timeout} s:\n{log.read_text()[-4000:]}")


def streamed_completion(client, prompt: list[int], new_tokens: int) -> dict:
    """One streaming completion request, greedy: its token ids (as the server streams them), the time to its first
    token and whether the stream said it finished."""
    started = time.perf_counter()
    first = None
    tokens: list[int] = []
    finish = None
    stream = client.completions.create(
        model="served",
        prompt=prompt,
        max_tokens=new_tokens,
        temperature=0.0,
        logprobs=1,
        stream=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.tokens:
                if first is None:
                    first = time.perf_counter() - started
                tokens.extend(int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens)
            finish = choice.finish_reason or finish
    return {"tokens": tokens, "ttft_s": None if first is None else round(first, 3), "finish_reason": finish}


def serve(
    model: Path, adapter: Optional[Path], prompts: list[list[int]], new_tokens: int, clients: int, folder: Path
) -> dict:
    """One server: every request alone, then all of them from `clients` concurrent streaming clients."""
    from openai import OpenAI

    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    max_len = max(map(len, prompts)) + new_tokens + 16
    name = "focus" if adapter is not None else "dense"
    with openai_server(model, adapter, max_len, folder / f"server_{name}.log", env) as url:
        client = OpenAI(base_url=url, api_key="unused", timeout=3600, max_retries=0)
        streamed_completion(client, prompts[0][:64], 2)  # one untimed request: one-time costs of the first calls
        load = [load_average()]
        started = time.perf_counter()
        alone = []
        for prompt in prompts:
            try:
                alone.append(streamed_completion(client, prompt, new_tokens))
            except Exception as error:
                alone.append({"error": f"{type(error).__name__}: {error}"})
        alone_wall = time.perf_counter() - started
        load.append(load_average())
        together, together_wall = run_concurrently(
            len(prompts), clients, lambda index: streamed_completion(client, prompts[index], new_tokens)
        )
        load.append(load_average())
    return {
        "alone": pass_summary(prompts, alone, alone_wall, new_tokens),
        "concurrent": {"clients": clients, **pass_summary(prompts, together, together_wall, new_tokens)},
        **compare(alone, together),
        "load_average_1m": load,
    }


# --- a plain transformers app ----------------------------------------------------------------------------------
def transformers_app(
    model_dir: Path, adapter: Path, prompts: list[list[int]], new_tokens: int, threads: int
) -> dict[str, dict]:
    """One model, Focus on and off: every request alone, then from `threads` threads at once."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import focus_hf

    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, adapter).eval()
    focus_hf.set_routing(model, "hard")

    def generate(prompt: list[int]) -> dict:
        ids = torch.tensor([prompt])
        started = time.perf_counter()
        with torch.inference_mode():
            output = model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
        return {"tokens": output[0, len(prompt) :].tolist(), "wall_s": round(time.perf_counter() - started, 3)}

    results = {}
    for variant in ("focus", "adapter disabled"):
        with model.disable_adapter() if variant != "focus" else contextlib.nullcontext():
            generate(prompts[0][:64])  # untimed: one-time costs of the first calls
            load = [load_average()]
            started = time.perf_counter()
            alone = []
            for prompt in prompts:
                try:
                    alone.append(generate(prompt))
                except Exception as error:
                    alone.append({"error": f"{type(error).__name__}: {error}"})
            alone_wall = time.perf_counter() - started
            load.append(load_average())
            together, together_wall = run_concurrently(len(prompts), threads, lambda index: generate(prompts[index]))
            load.append(load_average())
        results[variant] = {
            "alone": pass_summary(prompts, alone, alone_wall, new_tokens),
            "concurrent": {"threads": threads, **pass_summary(prompts, together, together_wall, new_tokens)},
            **compare(alone, together),
            "load_average_1m": load,
        }
    return results


def interpreter() -> str:
    """The Python that runs this, as a command line names it (relative to the repository where it lies in it)."""
    path = Path(sys.executable)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def speed(focus: dict, dense: dict, key: str) -> Optional[float]:
    """Focus's generated tokens per second over the other variant's, in one pass (None where it generated none)."""
    other = dense[key]["generated_tokens_per_s"]
    return round(focus[key]["generated_tokens_per_s"] / other, 3) if other else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="base model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--adapter", type=Path, default=ADAPTER, help="Focus adapter folder")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=100)
    parser.add_argument("--max-prompt", type=int, default=8000, help="SmolLM2 takes 8,192 positions in all")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients of each server")
    parser.add_argument("--threads", type=int, default=4, help="threads of the transformers app")
    parser.add_argument("--parts", nargs="+", choices=("vllm", "transformers"), default=["vllm", "transformers"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--note", help="what the record should say of the conditions (a shared machine, ...)")
    args = parser.parse_args()

    model_dir = args.model
    if model_dir is None:
        import focus_hf
        from focus_hf.aliases import default_cache_dir

        focus_hf.load_model_and_tokenizer("smollm2-135m-instruct")  # converts the GGUF once
        model_dir = default_cache_dir() / "models" / "smollm2-135m-instruct"
    lengths = prompt_lengths(args.requests, args.min_prompt, args.max_prompt)
    prompts = _prompts(model_dir, lengths)
    record: dict = {
        "benchmark": "benchmarks/serving_stress.py",
        "command": " ".join([interpreter(), "benchmarks/model/serving_stress.py", *sys.argv[1:]]),
        "note": args.note,
        "model": str(model_dir.name),
        "adapter": str(args.adapter.relative_to(ROOT)) if args.adapter.is_relative_to(ROOT) else str(args.adapter),
        "prompt_tokens": lengths,
        "new_tokens": args.new_tokens,
        "greedy": True,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    failures = 0
    if "vllm" in args.parts:
        import vllm

        with tempfile.TemporaryDirectory() as folder:
            focus = serve(model_dir, args.adapter, prompts, args.new_tokens, args.clients, Path(folder))
            dense = serve(model_dir, None, prompts, args.new_tokens, args.clients, Path(folder))
        record["vllm"] = {
            "version": vllm.__version__,
            "server": "OpenAI API server, CPU engine, eager, float32, prefix caching off, streaming clients",
            "focus": focus,
            "dense (vLLM's own attention)": dense,
            "focus_over_dense_generated_tokens_per_s": {
                "alone": speed(focus, dense, "alone"),
                "concurrent": speed(focus, dense, "concurrent"),
            },
        }
        failures += sum(part["concurrent"]["errors"] + part["concurrent"]["dropped"] for part in (focus, dense))
        failures += sum(len(part["unequal"]) for part in (focus, dense))
    if "transformers" in args.parts:
        import torch
        import transformers

        app = transformers_app(model_dir, args.adapter, prompts, args.new_tokens, args.threads)
        record["transformers"] = {
            "version": transformers.__version__,
            "torch": torch.__version__,
            "app": "one model, generate() greedy under inference_mode, torch at one thread per calling thread",
            **app,
            "focus_over_disabled_generated_tokens_per_s": {
                "alone": speed(app["focus"], app["adapter disabled"], "alone"),
                "concurrent": speed(app["focus"], app["adapter disabled"], "concurrent"),
            },
        }
        failures += sum(part["concurrent"]["errors"] + part["concurrent"]["dropped"] for part in app.values())
        failures += sum(len(part["unequal"]) for part in app.values())
    text = json.dumps(record, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
