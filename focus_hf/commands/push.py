"""`focus-hf push ADAPTER REPO_ID`: upload a saved Focus adapter folder to the Hub in one commit."""

from __future__ import annotations

import argparse
import sys

from focus_hf.commands.options import add_option


def run(args: argparse.Namespace) -> int:
    from focus_hf.hub import FocusHubError, plan_push, push_adapter

    try:
        if args.delete:
            plan = plan_push(args.adapter, args.repo_id, revision=args.revision, delete=True)
            if plan.deletions:
                listed = ", ".join(plan.deletions)
                print(f"Deleting from {args.repo_id}@{plan.branch} (the folder lacks them): {listed}")
        commit = push_adapter(
            args.adapter,
            args.repo_id,
            revision=args.revision,
            private=args.private,
            commit_message=args.commit_message,
            create_pr=args.create_pr,
            delete=args.delete,
            overwrite_readme=args.overwrite_readme,
        )
    except (FocusHubError, ValueError) as error:
        print(f"focus-hf push: error: {error}", file=sys.stderr)
        return 1
    print(f"Pushed {args.adapter} to {args.repo_id}" + (f" (branch {args.revision})" if args.revision else ""))
    print(f"  commit: {commit.oid}")
    print(f"  url:    {commit}")
    if commit.pr_url:
        print(f"  pull request: {commit.pr_url} (revision {commit.pr_revision})")
    pinned = f', revision="{commit.oid}"' if args.revision or args.create_pr else ""
    print(f'Load it with: PeftModel.from_pretrained(base_model, "{args.repo_id}"{pinned})')
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push",
        help="upload a saved Focus adapter folder to the Hugging Face Hub",
        description="Upload adapter_config.json, adapter_model.safetensors, README.md, the *.json/*.png/*.html "
        "interpretability files and .eval_results/*.yaml of ADAPTER in a single commit. Pickle and base-model "
        "weight files are refused. A push adds and updates files: it deletes files of the repo only with --delete "
        "(listed first), and a README.md edited on the Hub keeps its edits unless --overwrite-readme. The endpoint, "
        "token and cache are huggingface_hub's (HF_ENDPOINT, HF_TOKEN, HF_HOME).",
    )
    parser.add_argument("adapter", metavar="ADAPTER", help="the adapter folder (written by save_pretrained)")
    parser.add_argument("repo_id", metavar="REPO_ID", help="Hub repo id, namespace/name")
    add_option(parser, "--revision", help="branch to commit to (created if missing); default: main")
    visibility = parser.add_mutually_exclusive_group()
    add_option(visibility, "--private", action="store_true", default=None,
               help="create the repo private (default: the Hub's default for the namespace)")  # fmt: skip
    add_option(visibility, "--public", dest="private", action="store_false", default=None,
               help="create the repo public (an existing repo keeps its visibility either way)")  # fmt: skip
    add_option(parser, "--commit-message", help="commit message (default: 'Upload Focus adapter')")
    add_option(parser, "--create-pr", action="store_true", help="open a pull request instead of committing")
    add_option(parser, "--delete", action="store_true", help="also delete the repo's adapter files the folder lacks")
    add_option(parser, "--overwrite-readme", action="store_true",
               help="replace a README.md edited on the Hub by the local one (default: keep its edits)")  # fmt: skip
    parser.set_defaults(func=run)
