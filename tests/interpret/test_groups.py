"""`record_routing`: several observers of the same model at once, each with its own record."""

import torch
from peft import get_peft_model
from tiny_models import VOCAB, tiny_model

import focus_hf
from focus_hf.interpret.groups import record_routing


def test_nested_recorders_do_not_disturb_each_other():
    model = get_peft_model(tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, group_dim=8, window=4, top_k=2))
    model.eval()
    ids = torch.randint(3, VOCAB, (2, 16))
    with record_routing(model) as outer:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        inner_groups = focus_hf.group_assignments(model, ids)  # a second observer while the first records
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    routed = outer.routings()
    assert sorted(routed) == sorted(inner_groups)
    for index, calls in routed.items():
        assert len(calls) == 3  # its own two passes and group_assignments' one
        assert torch.equal(calls[1].top_groups, inner_groups[index])
    assert all(not layer.routing_observers for layer in focus_hf.focus_layers(model))
