"""`focus-hf pull REPO_ID`: download a Focus adapter from the Hub (or the local cache) and verify it."""

from __future__ import annotations

import argparse
import sys

from focus_hf.commands.options import add_option


def run(args: argparse.Namespace) -> int:
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from focus_hf.hub import FocusHubError, pull_adapter

    try:
        path = pull_adapter(
            args.repo_id, revision=args.revision, local_dir=args.local_dir, local_files_only=args.offline
        )
    except (FocusHubError, ValueError, HfHubHTTPError, LocalEntryNotFoundError) as error:
        print(f"focus-hf pull: error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pull",
        help="download and verify a Focus adapter from the Hugging Face Hub",
        description="Download the adapter files of REPO_ID through the huggingface_hub cache, check them against "
        "the Hub's checksums and the safetensors format, and print the verified folder (the cache snapshot, or "
        "--local-dir). --local-dir must be empty or written by an earlier pull: a pull never overwrites or deletes "
        "a file it did not write. Works offline from the cache (HF_HUB_OFFLINE=1 or --offline).",
    )
    parser.add_argument("repo_id", metavar="REPO_ID", help="Hub repo id, namespace/name")
    add_option(parser, "--revision", help="branch, tag or commit sha (default: main)")
    add_option(parser, "--local-dir", metavar="DIR", old=("--out",),
               help="also copy the verified files into DIR (empty, or written by an earlier pull)")  # fmt: skip
    add_option(parser, "--offline", action="store_true", help="use the local cache only")
    parser.set_defaults(func=run)
