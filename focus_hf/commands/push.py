"""`focus-hf push ADAPTER_DIR org/name`: upload a saved Focus adapter folder to the Hub in one commit."""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from focus_hf.hub import FocusHubError, push_adapter

    try:
        commit = push_adapter(
            args.adapter,
            args.repo_id,
            revision=args.revision,
            private=args.private,
            commit_message=args.commit_message,
            create_pr=args.create_pr,
        )
    except (FocusHubError, ValueError) as error:
        print(f"focus-hf push: error: {error}", file=sys.stderr)
        return 1
    print(f"Pushed {args.adapter} to {args.repo_id}" + (f" (branch {args.revision})" if args.revision else ""))
    print(f"  commit: {commit.oid}")
    print(f"  url:    {commit}")
    if commit.pr_url:
        print(f"  pull request: {commit.pr_url} (revision {commit.pr_revision})")
    pinned = f', adapter_kwargs={{"revision": "{commit.oid}"}}' if args.revision or args.create_pr else ""
    print(f'Load it with: import focus_hf; model.load_adapter("{args.repo_id}"{pinned})')
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push",
        help="upload a saved Focus adapter folder to the Hugging Face Hub",
        description="Upload adapter_config.json, adapter_model.safetensors, README.md and *.json/*.png/*.html "
        "interpretability files of ADAPTER_DIR in a single commit. Pickle and base-model weight files are "
        "refused. The endpoint, token and cache are huggingface_hub's (HF_ENDPOINT, HF_TOKEN, HF_HOME).",
    )
    parser.add_argument("adapter", metavar="ADAPTER_DIR", help="folder written by save_pretrained")
    parser.add_argument("repo_id", metavar="REPO_ID", help="Hub repo id, namespace/name")
    parser.add_argument("--revision", help="branch to commit to (created if missing); default: main")
    parser.add_argument("--private", action="store_true", help="create the repo as private (if it does not exist)")
    parser.add_argument("--commit-message", help="commit message (default: 'Upload Focus adapter')")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.set_defaults(func=run)
