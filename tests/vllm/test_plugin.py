"""The plugin is found by vLLM's entry point, replaces CPU_ATTN in the process that loads it, and refuses vLLM
releases it was not tested with."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.vllm


def test_entry_point_is_a_general_plugin():
    plugins = {plugin.name: plugin.value for plugin in entry_points(group="vllm.general_plugins")}
    assert plugins.get("focus") == "focus_hf.vllm.plugin:register"


def test_register_replaces_cpu_attention_backend():
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    load_general_plugins()  # what every vLLM process runs first
    from focus_hf.vllm.backend import FocusCPUAttentionBackend
    from focus_hf.vllm.plugin import BACKEND_PATH

    assert AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH
    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    assert backend is FocusCPUAttentionBackend and backend.get_name() == "CPU_ATTN"
    from vllm.model_executor.models.llama import LlamaAttention

    assert getattr(LlamaAttention, "_focus_wrapped", False)


def test_installed_vllm_is_supported():
    from focus_hf.vllm import SUPPORTED_VLLM, check_vllm_version

    assert check_vllm_version().split("+")[0] in SUPPORTED_VLLM


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "0.32.1"])
def test_other_vllm_releases_are_refused(version):
    from focus_hf.errors import FocusRuntimeError
    from focus_hf.vllm import check_vllm_version

    with pytest.raises(FocusRuntimeError, match=f"supports vLLM 0.32.0, found {version}"):
        check_vllm_version(version)


def test_side_cache_resumes_where_routing_stopped():
    """The column sums the side cache keeps per block are the state a call stopped after that block's last token
    returns."""
    import torch

    from focus_hf.attention.routing import RoutingState, route_tokens
    from focus_hf.errors import FocusRuntimeError
    from focus_hf.vllm.side_cache import SideCache

    scores = torch.randn(1, 40, 4) * 3
    valid = torch.ones(1, 40, dtype=torch.bool)
    options = dict(iterations=10, top_k=1, sink_tokens=2)
    empty = RoutingState.empty(1, 10, 4, scores.device)
    whole, state = route_tokens(scores, valid, empty, token_columns=True, **options)
    side = SideCache(num_blocks=4, block_size=16, iterations=10, groups=4, device=scores.device)
    block_row = torch.tensor([3, 0, 2], dtype=torch.int32)  # blocks in any order, as vLLM hands them out
    slots = side.slots(block_row, 40)
    cuts = (1, 16, 23, 24, 39, 40)  # calls end mid-block and on a block's end, as chunks and steps do
    for start, cut in zip((0,) + cuts, cuts):
        side.write(block_row, start, state.key_groups[0, start:cut], state.token_column_lse[0, start:cut])
        resumed = RoutingState.empty(1, 10, 4, scores.device)
        resumed.seen, resumed.valid_count = cut, torch.tensor([cut])
        resumed.column_lse = side.column_lse(block_row, cut - 1)
        tail, _ = route_tokens(scores[:, cut:], valid[:, cut:], resumed, **options)
        assert torch.equal(tail.top_groups, whole.top_groups[:, cut:])
        torch.testing.assert_close(tail.log_probs, whole.log_probs[:, cut:], atol=1e-5, rtol=1e-5)
    assert torch.equal(side.key_groups(slots), state.key_groups[0])
    # a whole block keeps the state after its last token (a prefix-cache hit resumes there); inside it, none
    torch.testing.assert_close(side.column_lse(block_row, 15), state.token_column_lse[0, 15][None])
    with pytest.raises(FocusRuntimeError, match="resume"):
        side.column_lse(block_row, 10)
