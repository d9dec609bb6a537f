"""Share a Focus adapter on the Hugging Face Hub: write its model card, push it in one commit, pull it back verified.

    python examples/push_to_hub.py ADAPTER_DIR your-name/smollm2-135m-focus            # a trained adapter folder
    python examples/push_to_hub.py --demo your-name/smollm2-135m-focus --revision dev  # an untrained demo adapter

The Hub is huggingface_hub's: https://huggingface.co unless HF_ENDPOINT (or --endpoint) names another one; log
in first (`hf auth login`) or set HF_TOKEN. To try it without an account, against a local Hub-compatible server
(e.g. the one in tests/support/hub_server.py, or any server speaking the Hub API):

    HF_ENDPOINT=http://127.0.0.1:8000 HF_TOKEN=hf_local python examples/push_to_hub.py --demo me/focus-demo

`focus-hf push ADAPTER_DIR org/name` and `focus-hf card ADAPTER_DIR` do the same from the command line.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def make_demo_adapter(model_name: str, folder: Path) -> None:
    """Attach an untrained Focus adapter to `model_name` and save it (routers at their initial values)."""
    import json

    from peft import get_peft_model

    import focus_hf
    from focus_hf import load_model_and_tokenizer
    from focus_hf.aliases import resolve_model_id

    model, _ = load_model_and_tokenizer(model_name)
    config = focus_hf.FocusConfig(num_groups=8, group_dim=16, window=128, top_k=2)
    get_peft_model(model, config).save_pretrained(folder)
    # Record the base's Hub id (an alias maps to the model it embeds; load_from_hub.py maps it back), not the
    # local folder the alias was converted into. Set after saving: PEFT would look a Hub id up while saving.
    config_path = folder / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = resolve_model_id(model_name)
    config_path.write_text(json.dumps(saved, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter", nargs="?", help="saved Focus adapter folder (or use --demo)")
    parser.add_argument("repo_id", help="Hub repo id, namespace/name")
    parser.add_argument("--demo", action="store_true", help="push an untrained adapter made on --model")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="base model of --demo")
    parser.add_argument("--revision", help="branch to commit to (default: main)")
    parser.add_argument("--private", action="store_true", default=None,
                        help="create the repo as private (default: the Hub's default for the namespace)")  # fmt: skip
    parser.add_argument("--no-card", action="store_true", help="keep the folder's README.md as it is")
    parser.add_argument("--endpoint", help="Hub endpoint (default: $HF_ENDPOINT or https://huggingface.co)")
    args = parser.parse_args()
    if args.endpoint:
        os.environ["HF_ENDPOINT"] = args.endpoint  # huggingface_hub reads it when first imported, just below
    if (args.adapter is None) == (not args.demo):
        parser.error("give either ADAPTER_DIR or --demo")

    from huggingface_hub import constants

    from focus_hf.card import write_model_card
    from focus_hf.hub import pull_adapter, push_adapter

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.adapter) if args.adapter else Path(scratch) / "adapter"
        if args.demo:
            make_demo_adapter(args.model, folder)
        if not args.no_card:
            print("model card:", write_model_card(folder, repo_id=args.repo_id))
        print(f"pushing {folder} to {args.repo_id} on {constants.ENDPOINT}")
        commit = push_adapter(folder, args.repo_id, revision=args.revision, private=args.private)
        print(f"commit {commit.oid}: {commit}")

        # Pull that exact commit back through the cache; pull_adapter checks sizes, checksums and the format.
        pulled = pull_adapter(args.repo_id, revision=commit.oid)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            assert (pulled / name).read_bytes() == (folder / name).read_bytes(), name
        print(f"pulled back and verified: {pulled}")
    revision = f', adapter_kwargs={{"revision": "{commit.oid}"}}' if args.revision else ""
    print(f'load it with: import focus_hf; model.load_adapter("{args.repo_id}"{revision})')


if __name__ == "__main__":
    main()
