"""Load a Focus adapter from the Hugging Face Hub through the standard PEFT / transformers paths and generate.

    python examples/load_from_hub.py your-name/smollm2-135m-focus
    python examples/load_from_hub.py your-name/smollm2-135m-focus --revision 1a2b3c4 --model smollm2-135m-instruct
    HF_HUB_OFFLINE=1 python examples/load_from_hub.py your-name/smollm2-135m-focus   # from the cache, no network

The Hub is huggingface_hub's: https://huggingface.co unless HF_ENDPOINT (or --endpoint) names another one, e.g. a
local Hub-compatible server: `HF_ENDPOINT=http://127.0.0.1:8000 python examples/load_from_hub.py me/focus-demo`.
Before injecting the adapter, focus_hf downloads the same revision's adapter_model.safetensors and checks it
against the Hub's checksum and the safetensors format; a corrupt or tampered file is refused with the model left
untouched.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repo_id", help="Hub repo id of a Focus adapter, namespace/name")
    parser.add_argument("--revision", help="branch, tag or commit sha (default: main)")
    parser.add_argument("--model", help="base model: alias, Hub id or folder (default: the adapter's base)")
    parser.add_argument("--prompt", default="Explain what a Python decorator is in two sentences.")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--endpoint", help="Hub endpoint (default: $HF_ENDPOINT or https://huggingface.co)")
    args = parser.parse_args()
    if args.endpoint:
        os.environ["HF_ENDPOINT"] = args.endpoint  # huggingface_hub reads it when first imported, just below

    import torch
    from peft import PeftModel

    import focus_hf  # registers the FOCUS adapter type with PEFT and transformers
    from focus_hf import load_model_and_tokenizer
    from focus_hf.files import model_for_adapter
    from focus_hf.hub import pull_adapter

    # Only to read the adapter's config (base model) before loading: pull_adapter verifies the files it caches.
    folder = pull_adapter(args.repo_id, revision=args.revision)
    base = args.model or model_for_adapter(folder)
    if base is None:
        parser.error("the adapter records no base model: pass --model")
    print(f"adapter {args.repo_id}@{folder.name[:12]} for base model {base}")

    # transformers path (the revision goes in adapter_kwargs) ...
    model, tokenizer = load_model_and_tokenizer(base)
    model.load_adapter(args.repo_id, adapter_kwargs={"revision": args.revision} if args.revision else None)
    # ... and the PEFT path give the same model.
    peft_model = PeftModel.from_pretrained(
        load_model_and_tokenizer(base)[0], args.repo_id, revision=args.revision
    ).eval()

    weights, peft_weights = model.state_dict(), peft_model.get_base_model().state_dict()
    same = weights.keys() == peft_weights.keys() and all(torch.equal(weights[k], peft_weights[k]) for k in weights)
    print(f"transformers and PEFT loads hold identical weights: {same}")

    messages = [{"role": "user", "content": args.prompt}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        # Not compared bit for bit: in a few fresh processes in 40, the first float32 forward rounds differently from
        # every later one (plain transformers too, without focus_hf), by about 3e-3 in SmolLM2's logits.
        difference = (model(**prompt).logits - peft_model(**prompt).logits).abs().max().item()
    print(f"their logits differ by at most {difference:.1e}")
    output = model.generate(**prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
    print("answer:", tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True))
    groups = focus_hf.group_assignments(model, prompt["input_ids"])
    print(f"layer 0 groups of the first 12 prompt tokens: {groups[min(groups)][0, :12, 0].tolist()}")


if __name__ == "__main__":
    main()
