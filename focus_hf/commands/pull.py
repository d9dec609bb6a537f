"""`focus-hf pull org/name`: download a Focus adapter from the Hub (or the local cache) and verify it."""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from focus_hf.hub import FocusHubError, pull_adapter

    try:
        path = pull_adapter(args.repo_id, revision=args.revision, out_dir=args.out, local_files_only=args.offline)
    except (FocusHubError, ValueError, HfHubHTTPError, LocalEntryNotFoundError) as error:
        print(f"focus-hf pull: error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pull",
        help="download and verify a Focus adapter from the Hugging Face Hub",
        description="Download the adapter files of REPO_ID through the huggingface_hub cache, check sizes and "
        "checksums against the Hub's listing and the safetensors format, and print the verified folder "
        "(the cache snapshot, or --out). Works offline from the cache (HF_HUB_OFFLINE=1 or --offline).",
    )
    parser.add_argument("repo_id", metavar="REPO_ID", help="Hub repo id, namespace/name")
    parser.add_argument("--revision", help="branch, tag or commit sha (default: main)")
    parser.add_argument("--out", metavar="DIR", help="also copy the verified files into DIR")
    parser.add_argument("--offline", action="store_true", help="use the local cache only")
    parser.set_defaults(func=run)
