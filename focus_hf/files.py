"""What a Focus adapter folder is: its file names, its format, and the checks run before any weights touch a model;
and how its files (and the caches beside them) are written: whole or not at all.

The one home of this knowledge: the core (loading), the Hub push / pull, the card and `focus-hf info` read it here.

An adapter folder holds `adapter_config.json` (with `"peft_type": "FOCUS"`) and `adapter_model.safetensors`
(router tensors only), plus an optional `README.md` model card and interpretability files (`*.json`, `*.png`,
`*.html`); `focus-hf train` keeps a `checkpoints/` folder beside them for resuming.

PEFT falls back to `adapter_model.bin` (a pickle) when no safetensors file is present, and transformers injects
the adapter layers before it reads the weights, so a corrupt or mismatching file would leave a half-modified model.
Focus adapters are a few hundred kilobytes, so reading the safetensors header up front costs nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import stat
import struct
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from focus_hf.errors import AdapterFileError, ConfigFormatError, FileWriteError

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
README_NAME = "README.md"
# `peft_type` of a Focus adapter config, also the name of the member added to peft's `PeftType` enum.
PEFT_TYPE_NAME = "FOCUS"
# Training checkpoints `focus-hf train` keeps inside the output folder (never pushed).
CHECKPOINTS_DIR = "checkpoints"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
ROUTER_LEAVES = ("focus_proj", "focus_centroids", "focus_query_proj")
_MAX_HEADER_BYTES = 100 * 1024 * 1024
# bits per element of the safetensors dtypes
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64,
    "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip


def give_mode_of(path: os.PathLike | str, like: os.PathLike | str) -> None:
    """Give the file `path` the permission bits of `like`, a file written beside it with `open()`.

    safetensors 0.8 writes through a temporary file created with mode 0600 and renames it into place
    (https://github.com/safetensors/safetensors/issues/782), so without this an adapter's weights are readable by their
    owner only while the config written beside them is readable by everyone the umask allows (0644 under the usual
    022).
    """
    os.chmod(path, stat.S_IMODE(os.stat(like).st_mode))


def read_safetensors_header(path: os.PathLike | str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Parse a safetensors file strictly and check it holds exactly the bytes its header declares.

    Checks: the header length fits the file; the header is a JSON object; `__metadata__` maps strings to
    strings; every tensor's byte range matches its dtype and shape; the tensors tile the data section exactly,
    without gap or overlap, up to the end of the file; and `safetensors.safe_open` agrees on the tensor names.
    Only the header is read (plus safetensors' own memory map), so this is cheap even for large files.

    Returns:
        tensor name -> (dtype, shape).

    Raises:
        AdapterFileError: the file is truncated, padded, or its header is not valid safetensors. The message
            names the file and says "corrupt" and/or "truncated".
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise AdapterFileError(
                f"{path} is not a safetensors file: {size} bytes, shorter than its 8-byte header length."
            )
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len == 0 or header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise AdapterFileError(
                f"{path} is corrupt or truncated: header claims {header_len} bytes, file has {size}."
            )
        raw_header = handle.read(header_len)
    try:
        header = json.loads(raw_header)
    except (UnicodeDecodeError, ValueError) as error:
        raise AdapterFileError(f"{path} is corrupt: its safetensors header is not valid JSON ({error}).") from None
    if not isinstance(header, dict):
        raise AdapterFileError(f"{path} is corrupt: its safetensors header is not a JSON object.")
    data_len = size - 8 - header_len
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise AdapterFileError(f"{path} is corrupt: its __metadata__ must map strings to strings.")
            continue
        try:
            dtype = entry["dtype"]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise AdapterFileError(f"{path} is corrupt: bad header entry for tensor {name!r}.") from None
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) or not (
            isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
        ):
            raise AdapterFileError(f"{path} is corrupt: bad shape or offsets for tensor {name!r}.")
        bits = _DTYPE_BITS.get(dtype)
        if bits is not None and (math.prod(shape) * bits + 7) // 8 != end - begin:
            raise AdapterFileError(
                f"{path} is corrupt: tensor {name!r} ({dtype}, shape {list(shape)}) needs "
                f"{(math.prod(shape) * bits + 7) // 8} bytes but its offsets span {end - begin}."
            )
        tensors[name] = (dtype, shape)
        ranges.append((begin, end, name))
    if not tensors:
        raise AdapterFileError(f"{path} is corrupt: it contains no tensors.")
    position = 0
    for begin, end, name in sorted(ranges):
        if begin != position:
            raise AdapterFileError(
                f"{path} is corrupt: tensor {name!r} starts at byte {begin}, expected {position} (gap or overlap)."
            )
        position = end
    if position != data_len:
        raise AdapterFileError(
            f"{path} is corrupt or truncated: its header describes {position} data bytes but the file holds "
            f"{data_len} (truncated or padded). Download or save the adapter again."
        )
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as reader:
            keys = set(reader.keys())
    except Exception as error:  # safetensors raises its own SafetensorError / OSError types
        raise AdapterFileError(f"{path} is corrupt: safetensors refused it ({error}).") from None
    if keys != set(tensors):
        raise AdapterFileError(f"{path} is corrupt: safetensors lists other tensors than its header.")
    return tensors


def router_module_name(key: str) -> tuple[str, str]:
    """Split a saved key such as `base_model.model.model.layers.0.self_attn.focus_proj` into (module, leaf)."""
    module, _, leaf = key.rpartition(".")
    return module.removeprefix("base_model.model."), leaf


# Every key PEFT saves starts with this prefix; both PEFT and transformers map only such keys onto the model. A key
# without it would be skipped silently and its router would keep its random initialisation.
ADAPTER_KEY_PREFIX = "base_model.model."
# Router tensors are floating point; anything else (int, bool, complex, fp8, fp4) would be cast silently.
ROUTER_DTYPES = ("F16", "BF16", "F32", "F64")


def validate_adapter_folder(
    folder: os.PathLike | str,
    expected: dict[str, dict[str, tuple[int, ...]]],
    saved: Optional[dict[str, tuple[int, ...]]] = None,
) -> dict:
    """Refuse a folder whose weights are missing, pickled, corrupt, non-finite, or shaped for another model.

    Args:
        folder: the adapter folder.
        expected: module name -> {"focus_proj": shape, "focus_centroids": shape} for the model being adapted.
        saved: key (without `base_model.model.`) -> shape of the tensors of the config's `modules_to_save`.

    Returns:
        The checked tensors (key -> CPU tensor), read once from `adapter_model.safetensors`: the loaders are handed
        these (`focus_hf.tuner.patches`), so what reaches the model is what was checked here.
    """
    folder = Path(folder)
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES) if folder.is_dir() else []
        if pickles:
            raise AdapterFileError(
                f"{folder} holds {pickles} but no {WEIGHTS_NAME}. Focus loads safetensors only and refuses pickle "
                "files, which can run arbitrary code. Convert it where you trust it: "
                "`safetensors.torch.save_file(torch.load(path, weights_only=True), 'adapter_model.safetensors')`."
            )
        raise AdapterFileError(f"Missing {WEIGHTS_NAME} in {folder}: the adapter folder is incomplete.")
    tensors = read_safetensors_header(weights)
    validate_router_tensors(str(weights), tensors, expected, require_prefix=True, saved=saved)
    from safetensors.torch import load_file

    tensors = load_file(str(weights))
    # The tensors read now are the ones handed to the loader (`focus_hf.tuner.patches`), so they are checked
    # themselves, not only the header read before: the file may have been replaced in between.
    validate_router_tensors(str(weights), _describe(tensors), expected, require_prefix=True, saved=saved)
    check_finite(str(weights), tensors)
    return tensors


# safetensors names of the torch dtypes a router may have (`ROUTER_DTYPES`).
_TORCH_DTYPE_NAMES = {
    "torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float32": "F32", "torch.float64": "F64",
}  # fmt: skip


def _describe(tensors: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (safetensors dtype name, shape) of torch tensors, as `read_safetensors_header` describes a file."""
    return {key: (_TORCH_DTYPE_NAMES.get(str(v.dtype), str(v.dtype)), tuple(v.shape)) for key, v in tensors.items()}


def validate_adapter_state_dict(
    state_dict: dict,
    expected: dict[str, dict[str, tuple[int, ...]]],
    saved: Optional[dict[str, tuple[int, ...]]] = None,
) -> None:
    """`validate_adapter_folder` for a state dict handed to `load_adapter(adapter_state_dict=...)`."""
    if not isinstance(state_dict, dict) or not all(hasattr(v, "dtype") for v in state_dict.values()):
        raise AdapterFileError("adapter_state_dict must map tensor names to tensors.")
    validate_router_tensors("adapter_state_dict", _describe(state_dict), expected, require_prefix=False, saved=saved)
    check_finite("adapter_state_dict", state_dict)


def check_finite(source: str, tensors: dict) -> None:
    """Refuse tensors holding NaN or infinite values (`source` names where they come from in the error)."""
    for key, tensor in tensors.items():
        if not bool(tensor.isfinite().all()):
            raise AdapterFileError(
                f"{source}: tensor {key!r} holds NaN or infinite values; refusing to load it (routing would give "
                "NaN). The adapter is corrupt or was saved after a diverged training run."
            )


def validate_router_tensors(
    source: str,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    expected: dict[str, dict[str, tuple[int, ...]]],
    *,
    require_prefix: bool,
    saved: Optional[dict[str, tuple[int, ...]]] = None,
) -> None:
    """Check tensor names, dtypes and shapes against the router tensors the model expects (`source` names them),
    and against `saved`, the tensors of the config's `modules_to_save` (key without prefix -> shape)."""
    saved = saved or {}
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    found_saved: set[str] = set()
    for key, (dtype, shape) in tensors.items():
        if require_prefix and not key.startswith(ADAPTER_KEY_PREFIX):
            raise AdapterFileError(
                f"{source} holds {key!r}, which lacks the {ADAPTER_KEY_PREFIX!r} prefix every PEFT adapter key has: "
                "it would not be loaded and its router would keep random weights. Save the adapter with "
                "`save_pretrained`, or rename the keys."
            )
        if dtype not in ROUTER_DTYPES:
            raise AdapterFileError(
                f"{source}: tensor {key!r} has dtype {dtype}; Focus adapter tensors are floating point "
                f"({', '.join(ROUTER_DTYPES)}). Refusing to cast it silently."
            )
        plain = key.removeprefix(ADAPTER_KEY_PREFIX)
        if plain in saved:
            if shape != saved[plain]:
                raise AdapterFileError(
                    f"{source}: {plain} (modules_to_save) has shape {list(shape)}, this model expects "
                    f"{list(saved[plain])}. The adapter was made for another base model."
                )
            found_saved.add(plain)
            continue
        module, leaf = router_module_name(key)
        if leaf not in ROUTER_LEAVES:
            raise AdapterFileError(
                f"{source} holds {key!r}, which is neither a Focus router tensor nor a tensor of the config's "
                f"modules_to_save ({sorted({k.rpartition('.')[0] for k in saved})}); refusing to load it."
            )
        found.setdefault(module, {})[leaf] = shape
    missing_saved = sorted(set(saved) - found_saved)
    if missing_saved:
        raise AdapterFileError(
            f"{source} is missing {len(missing_saved)} tensor(s) of the config's modules_to_save: "
            f"{missing_saved[:4]}{' ...' if len(missing_saved) > 4 else ''}. The file is incomplete, or "
            "adapter_config.json names modules the adapter did not save."
        )
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise AdapterFileError(
            f"{source} routes {len(found)} attention layers, this model has {len(expected)} routable ones"
            f"{'; missing: ' + str(missing[:3]) if missing else ''}"
            f"{'; unknown: ' + str(unexpected[:3]) if unexpected else ''}. "
            "The adapter was made for another base model."
        )
    absent = [
        f"{ADAPTER_KEY_PREFIX}{module}.{leaf} (shape {list(shape)})"
        for module, shapes in expected.items()
        for leaf, shape in shapes.items()
        if leaf not in found[module]
    ]
    if absent:
        raise AdapterFileError(
            f"{source} is missing {len(absent)} router tensor(s) this FocusConfig needs: {', '.join(absent[:4])}"
            f"{' ...' if len(absent) > 4 else ''}. The file is incomplete, or adapter_config.json (query_projection) "
            "does not match the weights; save the adapter again with save_pretrained."
        )
    for module, shapes in expected.items():
        extra = sorted(set(found[module]) - set(shapes))
        if extra:
            raise AdapterFileError(
                f"{source}: {module} holds {extra}, which this FocusConfig does not use (query_projection is off). "
                "The adapter_config.json does not match the weights."
            )
        for leaf, shape in shapes.items():
            got = found[module][leaf]
            if got != shape:
                raise AdapterFileError(
                    f"{source}: {module}.{leaf} has shape {list(got)}, this model expects "
                    f"{list(shape)}. The adapter was made for another base model or another FocusConfig."
                )


# Files pushed and pulled (fnmatch patterns on top-level names, as `huggingface_hub` `allow_patterns`); the
# interpretability files of `focus-hf inspect` / `focus-hf card` (interpretability.json, group_balance.png, an
# HTML page) are among them.
ADAPTER_FILE_PATTERNS: tuple[str, ...] = (
    CONFIG_NAME,
    WEIGHTS_NAME,
    README_NAME,
    "*.json",
    "*.png",
    "*.html",
)
# Full-model weight formats; any *.safetensors other than the adapter's is treated as base-model weights.
_BASE_WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".gguf", ".h5", ".msgpack", ".onnx", ".tflite")
_BASE_WEIGHT_INDEX_SUFFIXES: tuple[str, ...] = (".safetensors.index.json", ".bin.index.json")


def is_pickle(name: str) -> bool:
    """Whether a file name has a pickle suffix (``.bin``, ``.pt``, ``.pkl``...): such files can run code on load."""
    return name.lower().endswith(PICKLE_SUFFIXES)


def is_base_weight(name: str) -> bool:
    """Whether a file name is a model weight file or shard index other than the adapter's own weights."""
    lowered = name.lower()
    if lowered == WEIGHTS_NAME:
        return False
    return lowered.endswith(_BASE_WEIGHT_SUFFIXES) or lowered.endswith(_BASE_WEIGHT_INDEX_SUFFIXES)


def matches_adapter_patterns(name: str) -> bool:
    """Whether a top-level file name is one of `ADAPTER_FILE_PATTERNS` (so it is pushed and pulled)."""
    from huggingface_hub.utils import filter_repo_objects

    return bool(list(filter_repo_objects([name], allow_patterns=list(ADAPTER_FILE_PATTERNS))))


def read_focus_config(path: Path) -> dict[str, Any]:
    """Parse an adapter_config.json; raise `ConfigFormatError` unless it is a JSON object with peft_type FOCUS."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ConfigFormatError(f"{CONFIG_NAME} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ConfigFormatError(f"{CONFIG_NAME} is not a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != PEFT_TYPE_NAME:
        raise ConfigFormatError(
            f"{CONFIG_NAME} has peft_type {peft_type!r}, expected {PEFT_TYPE_NAME!r} (not a Focus adapter)"
        )
    return config


def adapter_summary(folder: Path) -> dict:
    """Config, parameter count, file size and base model of a local adapter folder."""
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise AdapterFileError(f"{folder} has no {CONFIG_NAME}: not an adapter folder.")
    config = json.loads(config_path.read_text())
    if config.get("peft_type") != PEFT_TYPE_NAME:
        raise AdapterFileError(f"{folder} holds a {config.get('peft_type')!r} adapter, not a Focus adapter.")
    weights = folder / WEIGHTS_NAME
    tensors = read_safetensors_header(weights) if weights.is_file() else {}
    parameters = 0
    for _, shape in tensors.values():
        count = 1
        for dim in shape:
            count *= dim
        parameters += count
    return {
        "base_model": config.get("base_model_name_or_path"),
        "base_model_type": config.get("base_model_type"),
        "parameters": parameters,
        "routed_layers": config.get("num_routed_layers"),
        "weights_bytes": weights.stat().st_size if weights.is_file() else None,
        "config": {
            k: config[k]
            for k in (
                "num_groups",
                "group_dim",
                "window",
                "top_k",
                "probe_mass",
                "sink_tokens",
                "temperature",
                "sinkhorn_iterations",
                "routing_mode",
                "query_projection",
                "dense_heads",
                "dense_below",
            )
            if k in config and config[k] is not None
        },
    }


def model_for_adapter(adapter: str | os.PathLike) -> Optional[str]:
    """The base model recorded in an adapter folder, mapped back to an alias when it is an embedded model's
    Hub id (so that the adapter loads on the very weights it was trained on, without network)."""
    config_path = Path(adapter) / CONFIG_NAME
    if not config_path.is_file():
        return None
    base = json.loads(config_path.read_text(encoding="utf-8")).get("base_model_name_or_path")
    from focus_hf.aliases import alias_of_hub_id

    return alias_of_hub_id(base) or base


# --- writing files whole or not at all --------------------------------------------------------------------------
def _new_file_mode() -> int:
    """The permission bits `open()` gives a new file under the process's umask (a temporary file gets 0600): read
    from /proc where it says (setting the umask to read it back would change it for every thread meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _write_failed(path: Path, error: BaseException) -> FileWriteError:
    return FileWriteError(
        f"Could not write {path} ({error}). The file there before, if any, is unchanged; free some space (or choose "
        "another folder) and write it again."
    )


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: OSError, and safetensors' own error (it reports a full disk as SafetensorError)."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return (OSError,)
    return (OSError, SafetensorError)


def _flush_to_disk(path: Path) -> None:
    """Have the file's bytes reach the disk before it is renamed into place (else a crash could leave it empty)."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


@contextlib.contextmanager
def replacing(path: Union[str, os.PathLike]) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write the new file to. When the block ends, the new file is
    flushed to disk and renamed over `path` (keeping the old file's permission bits, or a new file's): a reader sees
    the old file or the new one, never part of one. Where writing fails (a full disk, no permission) the old file is
    left as it was, the temporary file is removed, and `FileWriteError` says what failed.

    Raises:
        FileWriteError: the block or the rename failed with OSError (or safetensors' error for one).
    """
    path = Path(path)
    try:
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        os.close(handle)
    except OSError as error:
        raise _write_failed(path, error) from error
    temporary = Path(name)
    try:
        yield temporary
        _flush_to_disk(temporary)
        os.chmod(temporary, stat.S_IMODE(os.stat(path).st_mode) if path.exists() else _new_file_mode())
        os.replace(temporary, path)
    except _write_errors() as error:
        raise _write_failed(path, error) from error
    finally:
        temporary.unlink(missing_ok=True)


def write_atomically(path: Union[str, os.PathLike], data: Union[str, bytes]) -> None:
    """Write `data` (a str is written as UTF-8) to `path` whole or not at all (`replacing`).

    Raises:
        FileWriteError: the write failed; the file there before, if any, is unchanged.
    """
    with replacing(path) as temporary:
        temporary.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


@contextlib.contextmanager
def staged_folder(directory: Union[str, os.PathLike], keep: tuple[str, ...] = ()) -> Iterator[Path]:
    """A temporary folder inside `directory` for the block to save into (holding copies of the files named in `keep`,
    which the writer may read and update). When the block ends, each file in it replaces its namesake in `directory`,
    subfolders included, one rename each (every file is old or new, never part of one). Where the block fails, the
    staging folder is removed and `directory` is left as it was; a failed write (a full disk) is raised as
    `FileWriteError`.

    Raises:
        FileWriteError: the block or a rename failed with OSError (or safetensors' error for one).
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=directory, prefix=".saving-"))
    except OSError as error:
        raise _write_failed(directory, error) from error
    try:
        for name in keep:
            if (directory / name).is_file():
                shutil.copy2(directory / name, staging / name)
        yield staging
        written = sorted(path for path in staging.rglob("*") if path.is_file())
        for path in written:
            _flush_to_disk(path)
        for path in written:
            target = directory / path.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
    except _write_errors() as error:
        raise _write_failed(directory, error) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: Union[str, os.PathLike]) -> Iterator[None]:
    """Hold an advisory lock on the file `path` (created if missing) for the block: the processes and threads that
    take it take turns. The system drops it when its holder ends, however it ends. Where no lock can be had (no
    POSIX locks, an unwritable folder), the block runs unlocked: callers write through `replacing`, so that each
    writer is safe on its own."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    try:
        handle = open(path, "a+b")
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
