"""Fake Focus adapter folders for the Hub tests: files that look like an adapter, written by hand."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = "focus-test/tiny-focus"


def fake_adapter_folder(folder: Path, *, seed: int = 0, peft_type: str = "FOCUS") -> Path:
    """A fake Focus adapter folder: config, a couple of tensors, a model card and interpretability files."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": peft_type, "base_model_name_or_path": "tiny/base", "num_groups": 4, "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(seed)
    save_file(
        {
            "base_model.model.layers.0.self_attn.focus_proj.weight": torch.randn(4, 8, generator=generator),
            "base_model.model.layers.0.self_attn.focus_centroids": torch.randn(4, 2, generator=generator),
        },
        str(folder / "adapter_model.safetensors"),
    )
    (folder / "README.md").write_text("---\nlibrary_name: peft\ntags:\n- focus\n---\n# Tiny Focus adapter\n")
    (folder / "routing_stats.json").write_text(json.dumps({"seed": seed, "groups": [1, 2, 3, 4]}))
    (folder / "heads.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (folder / "attention_map.html").write_text("<html><body>routing</body></html>")
    (folder / "notes.txt").write_text("not part of the adapter, must not be uploaded")
    return folder


def folder_state(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file's sha256 and mtime, to prove a folder was left untouched."""
    return {
        p.relative_to(folder).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
