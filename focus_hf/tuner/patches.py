"""Every change focus_hf makes to peft and transformers objects, listed in `PATCHES` and made by `apply`.

PEFT has no plugin discovery and neither library hands an adapter type the moments Focus needs (the adapter being
loaded, before injection; the files it reads; a save), so focus_hf registers itself through their public registries
and wraps a few of their methods. `PATCHES` below is the table: what each entry changes, why, and the upstream
parameters and names it relies on; `docs/architecture.md` renders it with the versions it was checked against
(`CHECKED_AGAINST`). Upgrading peft or transformers means reading this module and running
`tests/tuner/test_patches.py`, which checks every entry's upstream signature.

`apply` (run once by `import focus_hf`, or right after `import peft`) first checks every entry it makes against the
installed libraries. An entry whose target moved, or whose parameters were renamed, raises `UpstreamChangedError`
naming the entry and the installed version where it is essential (checked loading, pickle refusals, registration),
and is left out with a warning where it is a convenience. `apply` is idempotent; `revert` puts back the methods it
wrapped (for tests; the registrations stay, as they change nothing for other adapter types).

Entries whose `where` names another module are applied there, because they must be: the import hooks run before
peft is imported (`focus_hf`, and `focus_hf_autoload`, stdlib only, started by `focus_hf.pth`), a KV cache's
reshuffles are followed on each cache object the routing states ride on (`focus_hf.tuner.cache_state`), and
`focus_hf.fitting.capture` registers its own attention function. vLLM's internals are patched by `focus_hf.vllm`,
pinned to the exact vLLM releases of `focus_hf.vllm.versions`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from focus_hf.errors import AdapterFileError, UpstreamChangedError
from focus_hf.files import CONFIG_NAME, PEFT_TYPE_NAME, README_NAME, WEIGHTS_NAME, give_mode_of, staged_folder
from focus_hf.tuner.adapter_load import checked_tensors, loading, loading_focus_adapter

logger = logging.getLogger(__name__)

# The versions every entry below was read and tested against (pyproject: transformers>=5,<5.24, peft>=0.21).
CHECKED_AGAINST = {"peft": "0.21.2", "transformers": "5.23.0"}


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change to an upstream object.

    Attributes:
        target: dotted path of the object changed (a module, a class, a function or a method).
        change: what is done to it ("wraps", "adds", "registers", "import hook"...).
        why: why Focus needs it.
        parameters: parameters of `target` the patch reads or passes on, in their upstream order.
        relies_on: other upstream names it reads, dotted; `name(a, b)` also needs the parameters a and b of `name`.
        make: name of the function of this module that applies it: a wrapper factory (`original -> wrapper`) where
            `change` is "wraps", else a function that takes no argument. None where `where` applies it.
        essential: whether focus_hf refuses to run without it (else it warns and runs without it).
        where: the module that applies it.
    """

    target: str
    change: str
    why: str
    parameters: tuple[str, ...] = ()
    relies_on: tuple[str, ...] = ()
    make: Optional[str] = None
    essential: bool = True
    where: str = __name__

    @property
    def library(self) -> str:
        return self.target.split(".")[0]


PATCHES: tuple[Patch, ...] = (
    Patch("peft.utils.PeftType", "adds the member FOCUS",
          "`register_peft_method` accepts only names of this enum, and transformers reads `peft_type.value.lower()`",
          relies_on=("peft.utils.peft_types.PeftType",), make="_add_focus_peft_type"),
    Patch("peft.utils.register_peft_method", "registers FOCUS (FocusConfig, FocusModel, prefix `focus_`)",
          "PEFT's loaders find an adapter type's config and tuner classes here",
          parameters=("name", "config_cls", "model_cls", "prefix"),
          relies_on=("peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING",), make="_register_peft_method"),
    Patch("transformers.AttentionInterface.register", "registers the attention function `focus`",
          "routed layers switch their config's `_attn_implementation` to it", parameters=("key", "value"),
          make="_register_attention"),
    Patch("transformers.masking_utils.AttentionMaskInterface.register", "registers `sdpa_mask` for `focus`",
          "without it the attention function receives `attention_mask=None` on padded batches",
          parameters=("key", "value"), relies_on=("transformers.masking_utils.sdpa_mask",), make="_register_mask"),
    Patch("peft.PeftModel.from_pretrained", "wraps: runs the load in `adapter_load.loading(model_id, kwargs)`",
          "the tuner checks the adapter's weights before injection, and must know where they come from",
          parameters=("model", "model_id", "kwargs"), make="_peft_from_pretrained"),
    Patch("peft.PeftModel.load_adapter", "wraps: `loading(model_id, kwargs)`; keeps a dispatched base's device map",
          "the adapter's source, as above; PEFT re-dispatches an offloaded base with an index made for LoRA "
          "(`focus_hf.tuner.dispatch.load_keeping_dispatch`)",
          parameters=("model_id", "adapter_name", "kwargs"),
          relies_on=("peft.PeftModel.get_base_model", "peft.PeftModel.peft_config"), make="_peft_load_adapter"),
    Patch("transformers.integrations.peft.PeftAdapterMixin.load_adapter",
          "wraps: `loading(source, download_kwargs)`, its Hub revision pinned to a commit and handed on",
          "the adapter's source (`AutoModel*.from_pretrained` on an adapter calls it too); the pinned commit makes "
          "the files the tuner checks the files transformers loads",
          parameters=("peft_model_id", "peft_config", "adapter_state_dict", "local_files_only", "adapter_kwargs",
                      "load_config", "kwargs"),
          relies_on=("transformers.modeling_utils.LoadStateDictConfig.pretrained_model_name_or_path",
                     "transformers.modeling_utils.LoadStateDictConfig.download_kwargs",
                     "transformers.utils.hub.resolve_revision(path_or_repo_id, revision, token, local_files_only, "
                     "cache_dir)"),
          make="_transformers_load_adapter"),
    Patch("transformers.PreTrainedModel._load_pretrained_model",
          "wraps: loads the tensors the tuner checked instead of the files transformers resolved",
          "`use_safetensors=False` would read `adapter_model.bin`, a pickle, beside the checked safetensors file",
          parameters=("model", "state_dict", "checkpoint_files", "load_config"),
          relies_on=("transformers.modeling_utils.LoadStateDictConfig.sharded_metadata",),
          make="_load_pretrained_model"),
    Patch("peft.utils.save_and_load.safe_load_file", "wraps: returns the tensors the tuner checked",
          "what PEFT's `load_peft_weights` reads is then what was checked", parameters=("filename", "device"),
          make="_safe_load_file"),
    Patch("peft.utils.save_and_load.torch_load", "wraps: refuses to read a pickle for a Focus adapter",
          "PEFT falls back to `adapter_model.bin` when no safetensors file is present", make="_torch_load"),
    Patch("peft.PeftModel.save_pretrained",
          "wraps: refuses `safe_serialization=False`, saves whole (staged), `save_embedding_layers=False`",
          "a pickle would be written that Focus refuses to load; PEFT's 'auto' asks the Hub on every save; a full "
          "disk must leave the previous save intact; safetensors 0.8 writes the weights 0600",
          parameters=("save_directory", "safe_serialization", "selected_adapters", "save_embedding_layers",
                      "is_main_process"),
          make="_peft_save_pretrained"),
    Patch("transformers.PreTrainedModel.save_pretrained",
          "wraps, for a model holding a Focus adapter: saves whole (staged); weights get the config's mode",
          "the same guarantees on transformers' `load_adapter` path", parameters=("save_directory",),
          make="_transformers_save_pretrained", essential=False),
    Patch("peft.PeftModel.set_adapter", "wraps: a list or tuple of names is checked (one at a time) first",
          "PEFT looks the name up before the tuner sees it and fails with 'unhashable type: list'",
          parameters=("adapter_name",), make="_set_adapter", essential=False),
    Patch("peft.PeftModel.__init__", "wraps: holds back one FutureWarning while wrapping a Focus model",
          "peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`, which a user cannot act on",
          parameters=("model", "peft_config"), make="_quiet_init", essential=False),
    Patch("transformers.Cache.reorder_cache", "wraps, per cache object: reorders the routing states too",
          "beam search reshuffles the cache's samples", parameters=("beam_idx",), where="focus_hf.tuner.cache_state"),
    Patch("transformers.Cache.batch_select_indices", "wraps, per cache object: selects in the routing states too",
          "contrastive search selects samples", parameters=("indices",), where="focus_hf.tuner.cache_state"),
    Patch("transformers.Cache.batch_repeat_interleave", "wraps, per cache object: repeats the routing states too",
          "contrastive search repeats samples", parameters=("repeats",), where="focus_hf.tuner.cache_state"),
    Patch("peft", "import hook: registers Focus right after peft's module code runs",
          "`import focus_hf` stays light (no torch) until peft is imported", where="focus_hf"),
    Patch("peft", "import hook, at interpreter start (`focus_hf.pth`): imports focus_hf once peft is imported",
          "the Hub's 'Use this model' snippet loads a Focus adapter without `import focus_hf`",
          where="focus_hf_autoload"),
    Patch("transformers.AttentionInterface.register", "registers the attention function `focus_capture`",
          "recall audits and distillation read each layer's post-RoPE queries and keys", parameters=("key", "value"),
          where="focus_hf.fitting.capture"),
)  # fmt: skip

PICKLE_LOAD_MESSAGE = (
    "Refusing to read a pickle (adapter_model.bin) for a Focus adapter: pickles can run arbitrary code, and Focus "
    "loads the checked adapter_model.safetensors only. Save the adapter with safe_serialization=True (the default)."
)
PICKLE_SAVE_MESSAGE = (
    "save_pretrained(safe_serialization=False) would write adapter_model.bin, a pickle, which Focus refuses to load "
    "(pickles can run arbitrary code). Save with the default safe_serialization=True (adapter_model.safetensors)."
)
_MARKER = "__focus_patch__"
_applied = False
_originals: list[tuple[Any, str, Any]] = []  # (owner, attribute, what it held), in the order wrapped


# --- applying the table ----------------------------------------------------------------------------------------


def apply() -> None:
    """Make every entry of `PATCHES` applied by this module (idempotent): check them all first, then apply."""
    global _applied
    if _applied:
        return
    skipped = set()
    for patch in PATCHES:
        if patch.where != __name__:
            continue
        problems = upstream_problems(patch)
        if problems:
            message = describe(patch, problems)
            if patch.essential:
                raise UpstreamChangedError(message)
            warnings.warn(message + " focus_hf runs without this patch.", RuntimeWarning, stacklevel=2)
            skipped.add(patch)
    for patch in PATCHES:
        if patch.where == __name__ and patch not in skipped:
            if patch.change.startswith("wraps"):
                _wrap(patch, globals()[patch.make])
            else:
                globals()[patch.make]()
    _applied = True


def revert() -> None:
    """Put back the upstream methods `apply` wrapped (the registrations stay); `apply` wraps them again."""
    global _applied
    while _originals:
        owner, name, original = _originals.pop()
        setattr(owner, name, original)
    _applied = False


def _wrap(patch: Patch, make: Callable[[Callable], Callable]) -> None:
    owner, name = _resolve(patch.target)
    original = inspect.getattr_static(owner, name)  # a class's own descriptor: staticmethod / classmethod kept
    function = _function(original)
    if getattr(function, _MARKER, None) == patch.target:
        return  # wrapped already (this module reloaded)
    wrapped = functools.wraps(function)(make(function))
    setattr(wrapped, _MARKER, patch.target)
    if isinstance(original, (staticmethod, classmethod)):
        wrapped = type(original)(wrapped)
    _originals.append((owner, name, original))
    setattr(owner, name, wrapped)


def _function(value: Any) -> Any:
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _resolve(target: str) -> tuple[Any, str]:
    """(owner, attribute name) of a dotted upstream name: the longest importable module, then attributes."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:-1]:
            owner = getattr(owner, part)
        return owner, parts[-1]
    raise ImportError(f"no module of {target!r} can be imported")


def upstream(target: str) -> Any:
    """The upstream object at `target`: for a method this module wrapped, the function it replaced."""
    owner, name = _resolve(target)
    for wrapped_owner, wrapped_name, original in _originals:
        if wrapped_owner is owner and wrapped_name == name:
            return _function(original)
    return _function(inspect.getattr_static(owner, name))


def _has(owner: Any, name: str) -> bool:
    if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
        return True
    if isinstance(owner, type) and name in getattr(owner, "__annotations__", {}):
        return True  # an instance attribute the class declares
    return hasattr(owner, name)


def _parameter_problems(function: Any, names: tuple[str, ...], label: str) -> list[str]:
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError) as error:
        return [f"{label} has no signature ({error})"]
    found = [p.name if p.kind is not inspect.Parameter.VAR_KEYWORD else "kwargs" for p in parameters]
    missing = [name for name in names if name not in found]
    if missing:
        return [f"{label}{inspect.signature(function)} has no parameter {', '.join(map(repr, missing))}"]
    positions = [found.index(name) for name in names]
    if positions != sorted(positions):
        return [f"{label}{inspect.signature(function)} no longer takes {', '.join(names)} in that order"]
    return []


def upstream_problems(patch: Patch) -> list[str]:
    """What of the installed peft / transformers no longer matches what `patch` relies on (empty: all is there)."""
    if patch.change.startswith("import hook"):
        spec = importlib.util.find_spec(patch.target)
        ok = spec is not None and hasattr(spec.loader, "exec_module")
        return [] if ok else [f"{patch.target}'s module spec has no loader with exec_module"]
    problems = []
    try:
        target = upstream(patch.target)
    except (ImportError, AttributeError) as error:
        return [f"{patch.target} is gone ({type(error).__name__}: {error})"]
    if patch.parameters:
        problems += _parameter_problems(target, patch.parameters, patch.target)
    for name in patch.relies_on:
        dotted, _, arguments = name.partition("(")
        try:
            owner, attribute = _resolve(dotted)
        except (ImportError, AttributeError) as error:
            problems.append(f"{dotted} is gone ({type(error).__name__}: {error})")
            continue
        if not _has(owner, attribute):
            problems.append(f"{dotted} is gone")
        elif arguments:
            wanted = tuple(a.strip() for a in arguments.rstrip(")").split(","))
            problems += _parameter_problems(getattr(owner, attribute), wanted, dotted)
    return problems


def installed_version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe(patch: Patch, problems: list[str]) -> str:
    """The error of an entry that upstream changed: the entry, the change found, the versions."""
    checked = CHECKED_AGAINST.get(patch.library, "?")
    return (
        f"focus_hf's patch of {patch.target} ({patch.change}; needed because {patch.why}) does not fit "
        f"{patch.library} {installed_version(patch.library)}: {'; '.join(problems)}. It was checked against "
        f"{patch.library} {checked}: install that version (`pip install \"{patch.library}=={checked}\"`) or a "
        f"focus_hf release that supports yours. The patches are listed in {__name__}."
    )


def table() -> str:
    """The patches as a Markdown table (docs/architecture.md)."""
    lines = ["| upstream object | what focus_hf does | why | checked against | where |", "|---|---|---|---|---|"]
    for patch in PATCHES:
        checked = f"{patch.library} {CHECKED_AGAINST[patch.library]}" if patch.library in CHECKED_AGAINST else ""
        cells = (f"`{patch.target}`", patch.change, patch.why, checked, f"`{patch.where}`")
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


# --- registrations ---------------------------------------------------------------------------------------------


def _add_focus_peft_type() -> None:
    from peft.utils import PeftType

    if PEFT_TYPE_NAME in PeftType.__members__:
        return
    member = str.__new__(PeftType, PEFT_TYPE_NAME)
    member._name_ = member._value_ = PEFT_TYPE_NAME
    member.__objclass__ = PeftType
    member.__init__(PEFT_TYPE_NAME)
    type.__setattr__(PeftType, PEFT_TYPE_NAME, member)
    PeftType._member_names_.append(PEFT_TYPE_NAME)
    PeftType._member_map_[PEFT_TYPE_NAME] = member
    PeftType._value2member_map_[PEFT_TYPE_NAME] = member


def _register_peft_method() -> None:
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    from peft.utils import register_peft_method

    from focus_hf.tuner.config import FocusConfig
    from focus_hf.tuner.model import FocusModel

    if PEFT_TYPE_NAME not in PEFT_TYPE_TO_CONFIG_MAPPING:
        register_peft_method(name=PEFT_TYPE_NAME.lower(), config_cls=FocusConfig, model_cls=FocusModel, prefix="focus_")


def _register_attention() -> None:
    from transformers import AttentionInterface

    from focus_hf.attention.function import ATTENTION_NAME, focus_attention_forward

    AttentionInterface.register(ATTENTION_NAME, focus_attention_forward)


def _register_mask() -> None:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from focus_hf.attention.function import ATTENTION_NAME

    # The attention function decodes padding from the same boolean masks SDPA receives.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


# --- loading: the adapter's source, the checked tensors, no pickle ----------------------------------------------


def _is_focus(config: Any) -> bool:
    return getattr(config, "peft_type", None) == PEFT_TYPE_NAME


def _peft_from_pretrained(original: Callable) -> Callable:
    def from_pretrained(cls, model, model_id, *args, **kwargs):
        # kwargs hold revision, subfolder, cache_dir, token...: PEFT hands them to hf_hub_download as they are.
        with loading(model_id, kwargs):
            return original(cls, model, model_id, *args, **kwargs)

    return from_pretrained


def _peft_load_adapter(original: Callable) -> Callable:
    def load_adapter(self, model_id, adapter_name, *args, **kwargs):
        from focus_hf.tuner import dispatch

        # Loading into a Focus adapter that exists (PeftModel.from_pretrained created it) reads Focus weights.
        focus = _is_focus(getattr(self, "peft_config", {}).get(adapter_name))
        with loading(model_id, kwargs, focus=focus):
            device_map = getattr(self.get_base_model(), "hf_device_map", None)
            if focus and len(self.peft_config) == 1 and dispatch.is_offloaded(device_map):
                return dispatch.load_keeping_dispatch(original, self, model_id, adapter_name, *args, **kwargs)
            return original(self, model_id, adapter_name, *args, **kwargs)

    return load_adapter


def _transformers_load_adapter(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def load_adapter(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        source, download_kwargs = _transformers_source(bound.arguments)
        with loading(source, download_kwargs):
            return original(*bound.args, **bound.kwargs)

    return load_adapter


def _transformers_source(arguments: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(adapter source, download kwargs) of a call of transformers' `load_adapter`, merged as it merges them: its
    `kwargs` override `load_config`'s fields, and `adapter_kwargs` its download kwargs (without a `peft_config`).

    transformers pins a Hub revision to its commit before it reads the adapter; the same pinning is done here and
    handed on in `adapter_kwargs` (transformers keeps a revision pinned for the same repo as it is), so that the files
    the tuner checks come from the commit transformers loads."""
    if arguments.get("adapter_state_dict") is not None:
        return arguments["adapter_state_dict"], {}
    from transformers.utils.hub import resolve_revision

    load_config, extra = arguments.get("load_config"), arguments.get("kwargs") or {}
    source = (
        arguments.get("peft_model_id")
        or extra.get("pretrained_model_name_or_path")
        or getattr(load_config, "pretrained_model_name_or_path", None)
    )
    download = dict(extra.get("download_kwargs") or getattr(load_config, "download_kwargs", None) or {})
    if arguments.get("local_files_only"):
        download["local_files_only"] = True
    if arguments.get("peft_config") is None and source is not None:
        download.update(arguments.get("adapter_kwargs") or {})
        revision = download.get("revision")
        pinned = resolve_revision(
            source,
            revision,
            token=download.get("token"),
            local_files_only=bool(download.get("local_files_only", False)),
            cache_dir=download.get("cache_dir"),
        )
        if pinned is not revision:
            download["revision"] = pinned
            arguments["adapter_kwargs"] = {**(arguments.get("adapter_kwargs") or {}), "revision": pinned}
    return source, download


def _load_pretrained_model(original: Callable) -> Callable:
    def load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        tensors = checked_tensors()
        if tensors is not None:
            if checkpoint_files and any(not str(f).endswith(".safetensors") for f in checkpoint_files):
                logger.warning(
                    "use_safetensors=False does not apply to Focus adapters: the checked "
                    "adapter_model.safetensors is loaded, never adapter_model.bin."
                )
            # None, not []: transformers' disk-offload indexing reads checkpoint_files[0] unless it is None.
            state_dict, checkpoint_files = tensors, None
            load_config = dataclasses.replace(load_config, sharded_metadata={})
        elif loading_focus_adapter():
            raise AdapterFileError(PICKLE_LOAD_MESSAGE)
        return original(model, state_dict, checkpoint_files, load_config, *args, **kwargs)

    return load_pretrained_model


def _safe_load_file(original: Callable) -> Callable:
    def safe_load_file(filename, device="cpu", **kwargs):
        tensors = checked_tensors()
        if tensors is not None:
            return {key: value.to(device) for key, value in tensors.items()}
        loaded = original(filename, device=device, **kwargs)
        if loading_focus_adapter():
            # Reloading weights into an adapter that already exists: no injection, so nothing was checked.
            from focus_hf.files import check_finite

            check_finite(str(filename), loaded)
        return loaded

    return safe_load_file


def _torch_load(original: Callable) -> Callable:
    def torch_load(*args, **kwargs):
        if loading_focus_adapter():
            raise AdapterFileError(PICKLE_LOAD_MESSAGE)
        return original(*args, **kwargs)

    return torch_load


# --- saving: safetensors only, whole or not at all ---------------------------------------------------------------


def _is_focus_model(peft_model: Any) -> bool:
    from focus_hf.tuner.model import FocusModel

    return isinstance(getattr(peft_model, "base_model", None), FocusModel)


def _peft_save_pretrained(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def save_pretrained(self, *args, **kwargs):
        if not _is_focus_model(self):
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        if not bound.get("safe_serialization", True):
            # Refused before anything is written, also when the caller passes `state_dict=` (then PEFT never calls
            # the model's `state_dict()`).
            raise AdapterFileError(PICKLE_SAVE_MESSAGE)
        if "save_embedding_layers" not in bound:
            # Focus never holds embedding weights; PEFT's "auto" would ask the Hub whether the base's vocabulary
            # changed (a network call on every save, failing offline).
            kwargs["save_embedding_layers"] = False
        result = _saved_whole(original, signature, self, args, kwargs)
        if bound.get("is_main_process", True):
            directory = Path(bound["save_directory"])
            names = bound.get("selected_adapters") or list(self.peft_config)
            # PEFT saves an adapter other than "default" into a subfolder of its name.
            _give_weights_the_config_mode([directory if name == "default" else directory / name for name in names])
        return result

    return save_pretrained


def _transformers_save_pretrained(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def save_pretrained(self, save_directory, *args, **kwargs):
        loaded = getattr(self, "_hf_peft_config_loaded", False)
        peft_configs = getattr(self, "peft_config", None) if loaded else None
        if not isinstance(peft_configs, dict) or not any(_is_focus(config) for config in peft_configs.values()):
            return original(self, save_directory, *args, **kwargs)
        result = _saved_whole(original, signature, self, (save_directory, *args), kwargs)
        _give_weights_the_config_mode([Path(save_directory)])
        return result

    return save_pretrained


def _saved_whole(save: Callable, signature: inspect.Signature, model: Any, args: tuple, kwargs: dict) -> Any:
    """`save(model, *args, **kwargs)` (a `save_pretrained`) run into a staging folder inside its `save_directory`,
    whose files then replace those there (`files.staged_folder`; the model card there is handed to it, which PEFT
    updates): a save that fails part way - a full disk - leaves the adapter saved there before as it was and raises
    `FileWriteError`."""
    bound = signature.bind(model, *args, **kwargs)
    directory = bound.arguments["save_directory"]
    if Path(directory).is_file():
        return save(model, *args, **kwargs)  # the save's own error names the mistake
    with staged_folder(directory, keep=(README_NAME,)) as staging:
        bound.arguments["save_directory"] = str(staging)
        return save(*bound.args, **bound.kwargs)


def _give_weights_the_config_mode(folders: list[Path]) -> None:
    """The safetensors file of each saved adapter folder gets the mode of the config written beside it
    (`focus_hf.files.give_mode_of`: safetensors 0.8 writes it 0600)."""
    for folder in folders:
        weights, config = folder / WEIGHTS_NAME, folder / CONFIG_NAME
        if weights.is_file() and config.is_file():
            give_mode_of(weights, config)


# --- conveniences ----------------------------------------------------------------------------------------------


def _set_adapter(original: Callable) -> Callable:
    def set_adapter(self, adapter_name, *args, **kwargs):
        if isinstance(adapter_name, (list, tuple)) and _is_focus_model(self):
            from focus_hf.tuner.model import check_single_adapter

            check_single_adapter(adapter_name)  # more than one name: refused, nothing changed
            if len(adapter_name) == 1:
                adapter_name = adapter_name[0]
        return original(self, adapter_name, *args, **kwargs)

    return set_adapter


def _quiet_init(original: Callable) -> Callable:
    def __init__(self, model, peft_config, *args, **kwargs):
        if not _is_focus(peft_config):
            return original(self, model, peft_config, *args, **kwargs)
        from focus_hf.quiet import quiet_peft_wrapping

        with quiet_peft_wrapping():
            return original(self, model, peft_config, *args, **kwargs)

    return __init__
