"""The `vllm.general_plugins` entry point: what vLLM runs in each of its processes before it builds an engine.

`register` (1) replaces the CPU engine's `CPU_ATTN` backend by `backend.FocusCPUAttentionBackend`, which behaves
exactly as `CPU_ATTN` in layers without a router, (2) wraps the supported attention modules so that they route
(`model_hooks`), and (3) wraps the platform's configuration hook, which vLLM calls on every engine configuration it
builds: with `additional_config={"focus_adapter": ...}` it refuses what Focus cannot serve (`checks`), fetches and
checks the adapter against the served model (`adapter`), runs the model eagerly (the routers' hooks are plain Python
around vLLM's attention op, which torch.compile's graphs would not keep) and logs what it loaded.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

from focus_hf.errors import FocusError, FocusServingError
from focus_hf.vllm.adapter import served_adapter
from focus_hf.vllm.checks import check_engine, requested_adapter
from focus_hf.vllm.versions import SUPPORTED_VLLM, installed_vllm

logger = logging.getLogger("focus_hf.vllm")
BACKEND_PATH = "focus_hf.vllm.backend.FocusCPUAttentionBackend"
_registered = False


def register() -> None:
    """Install Focus in this vLLM process (idempotent: vLLM may load plugins more than once)."""
    global _registered
    if _registered:
        return
    version = installed_vllm()
    if version is None or version.split("+")[0] not in SUPPORTED_VLLM:
        # Nothing else is touched on a release whose internals were not checked; a server that asks for an
        # adapter is still refused (never served dense), by this hook alone.
        _wrap_platform_hook(_refuse_version(version))
        _registered = True
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    from focus_hf.vllm import model_hooks

    model_hooks.install()
    _wrap_platform_hook(_prepare_engine)
    _registered = True


def _refuse_version(version: Optional[str]):
    def check(vllm_config: Any, platform_name: str) -> None:
        if requested_adapter(vllm_config.additional_config) is not None:
            from focus_hf.vllm.versions import check_vllm_version

            check_vllm_version(version or "unknown")

    return check


def _wrap_platform_hook(check) -> None:
    from vllm.platforms import current_platform

    platform = type(current_platform)
    original = platform.check_and_update_config
    if getattr(original, "_focus_wrapped", False):
        return

    @functools.wraps(original)
    def check_and_update_config(vllm_config: Any) -> None:
        check(vllm_config, current_platform.device_type)
        return original(vllm_config)

    check_and_update_config._focus_wrapped = True
    platform.check_and_update_config = staticmethod(check_and_update_config)


def _prepare_engine(vllm_config: Any, platform_name: str) -> None:
    requested = requested_adapter(vllm_config.additional_config)
    if requested is None or vllm_config.model_config is None:
        return
    check_engine(vllm_config, platform_name)
    try:
        adapter = served_adapter(vllm_config)
    except FocusError as error:
        if isinstance(error, FocusServingError):
            raise
        # The Hub and file checks raise ValueErrors, which vLLM's pydantic validation would wrap out of sight.
        raise FocusServingError(f"Focus adapter {requested[0]!r} refused: {error}") from error
    _run_eagerly(vllm_config)
    logger.info("%s", adapter.describe())
    print(f"focus_hf.vllm: {adapter.describe()}", flush=True)


def _run_eagerly(vllm_config: Any) -> None:
    from vllm.config import CompilationMode, CUDAGraphMode

    vllm_config.model_config.enforce_eager = True
    vllm_config.compilation_config.mode = CompilationMode.NONE
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
