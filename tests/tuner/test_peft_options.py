"""What a PEFT user expects of any adapter type: errors that name the problem, the options LoRA users pass
(`modules_to_save`, `layers_to_transform` / `layers_pattern`, `init_weights`), and a fresh adapter that routes in the
mode of the model it is added to."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.utils.other import ModulesToSaveWrapper
from safetensors.torch import load_file, save_file
from tiny_models import assert_unmodified, ids, make_adapter, snapshot, tiny_model

import focus_hf
from focus_hf.errors import AdapterFileError, FocusConfigError, FocusRuntimeError, UnknownOptionError
from focus_hf.tuner.layer import FocusLayer


def logits_of(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids()).logits


def train_one_step(model) -> None:
    """One SGD step of the language-model loss in train mode (soft routing), then back to eval mode."""
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids=ids(), labels=ids()).loss.backward()
    optimizer.step()
    model.eval()


def reloaded_logits(folder, architecture: str) -> list[torch.Tensor]:
    """Logits of the adapter in `folder` loaded by PEFT and by transformers on fresh bases."""
    peft_model = PeftModel.from_pretrained(tiny_model(architecture), folder)
    base = tiny_model(architecture)
    base.load_adapter(str(folder))
    return [logits_of(peft_model), logits_of(base)]


# --- errors that name the problem ------------------------------------------------------------------------------
def test_missing_router_tensor_is_named_as_missing(tmp_path):
    make_adapter(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    del tensors["base_model.model.model.layers.1.self_attn.focus_centroids"]
    save_file(tensors, weights)
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(AdapterFileError) as error:
        PeftModel.from_pretrained(model, tmp_path / "adapter")
    message = str(error.value)
    assert "missing 1 router tensor" in message
    assert "base_model.model.model.layers.1.self_attn.focus_centroids (shape [4, 16])" in message
    assert "shape None" not in message
    assert_unmodified(model, before)


def test_unknown_option_is_a_config_error_and_a_type_error():
    with pytest.raises(UnknownOptionError) as error:
        focus_hf.FocusConfig(num_groups=4, not_an_option=1)
    assert isinstance(error.value, FocusConfigError) and isinstance(error.value, TypeError)
    assert "not_an_option" in str(error.value) and "Known options" in str(error.value)
    try:  # what PEFT's tests and users write
        focus_hf.FocusConfig(bias="all")
    except TypeError as caught:
        assert "trains no bias" in str(caught) and "docs/limitations.md" in str(caught)
    with pytest.raises(TypeError, match="no low-rank weight update"):
        focus_hf.FocusConfig(r=8, lora_alpha=16)


@pytest.mark.parametrize("loader", ["peft", "transformers"])
def test_unknown_key_in_adapter_config_still_fails_loudly(tmp_path, loader):
    # PEFT drops unknown keys with a warning when the TypeError says "got an unexpected keyword argument"; Focus's
    # error does not, so it reaches the user.
    make_adapter(tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(path.read_text())
    config["routing_budget"] = 3
    path.write_text(json.dumps(config))
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(UnknownOptionError, match="routing_budget"):
        if loader == "peft":
            PeftModel.from_pretrained(model, tmp_path / "adapter")
        else:
            model.load_adapter(str(tmp_path / "adapter"))
    assert_unmodified(model, before)


# --- modes that follow the model -------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["get_peft_model", "add_adapter"])
def test_fresh_adapter_on_an_eval_model_routes_as_its_reloaded_copy(tmp_path, how):
    config = focus_hf.FocusConfig(num_groups=4, window=8)
    if how == "get_peft_model":
        model = get_peft_model(tiny_model("llama").eval(), config)
    else:
        model = tiny_model("llama").eval()
        model.add_adapter(config)
    layers = [m for m in model.modules() if isinstance(m, FocusLayer)]
    assert layers and not any(layer.training for layer in layers)
    with torch.no_grad():
        fresh = model(input_ids=ids()).logits  # no eval() call after adding: the mode it was added in
    if how == "get_peft_model":
        model.save_pretrained(tmp_path / "adapter")
        reloaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter")
    else:
        model.save_pretrained(tmp_path / "adapter")
        reloaded = tiny_model("llama")
        reloaded.load_adapter(str(tmp_path / "adapter"))
    assert torch.equal(logits_of(reloaded), fresh)


def test_fresh_adapter_on_a_train_model_trains():
    model = get_peft_model(tiny_model("llama").train(), focus_hf.FocusConfig(num_groups=4, window=8))
    assert all(m.training for m in model.modules() if isinstance(m, FocusLayer))
    model(input_ids=ids(), labels=ids()).loss.backward()  # soft routing: the routers get gradients
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "focus_" in n)


def test_backward_through_an_eval_mode_adapter_says_why():
    # Eval mode routes hard, which gives the routers no gradient. Where something else trains (here the embeddings'
    # output, as gradient checkpointing arranges), the backward pass says so rather than leave the routers untrained.
    model = get_peft_model(tiny_model("llama").eval(), focus_hf.FocusConfig(num_groups=4, window=2, sink_tokens=0))
    reference = logits_of(model)
    model.enable_input_require_grads()
    output = model(input_ids=ids(), labels=ids())
    # The same routing (up to the rounding of the differentiable attention path that inputs needing grad take).
    torch.testing.assert_close(output.logits.detach(), reference, atol=1e-5, rtol=1e-5)
    with pytest.raises(FocusRuntimeError, match=r"eval mode.*model\.train\(\)"):
        output.loss.backward()
    # With nothing else trainable the loss needs no gradient, and torch refuses the backward pass itself; the forward
    # pass has warned why (PEFT's own training tests call no model.train(): for LoRA, eval mode only stops dropout).
    plain = get_peft_model(tiny_model("llama").eval(), focus_hf.FocusConfig(num_groups=4, window=2, sink_tokens=0))
    with pytest.warns(UserWarning, match=r"eval mode.*no gradient.*model\.train\(\).*torch\.no_grad\(\)"):
        loss = plain(input_ids=ids(), labels=ids()).loss
    with pytest.raises(RuntimeError, match="does not require grad"):
        loss.backward()


def test_eval_mode_warning_where_the_routers_would_silently_stay_untrained():
    # transformers' test_peft_add_adapter_modules_to_save: lm_head trains, so the loss has a gradient, but the routers
    # (hard routing, eval mode) get none; the forward pass warns instead of leaving that unsaid.
    model = tiny_model("llama").eval()
    model.add_adapter(focus_hf.FocusConfig(num_groups=4, window=2, sink_tokens=0, modules_to_save=["lm_head"]))
    with pytest.warns(UserWarning, match="eval mode"):
        model(input_ids=ids()).logits.mean().backward()
    routers = [p for n, p in model.named_parameters() if "focus_" in n]
    assert routers and all(p.requires_grad and p.grad is None for p in routers)
    model.train()  # the fix the warning names: soft routing, every trainable parameter gets a gradient
    model(input_ids=ids()).logits.mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_no_eval_mode_warning_where_no_router_could_train(tmp_path, recwarn):
    # Inference: under no_grad / inference_mode, or a loaded adapter (its routers need no gradient), or train mode.
    model = get_peft_model(tiny_model("llama").eval(), focus_hf.FocusConfig(num_groups=4, window=2, sink_tokens=0))
    with torch.no_grad():
        model(input_ids=ids())
    with torch.inference_mode():
        model(input_ids=ids())
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter")
    reloaded(input_ids=ids())
    model.train()
    model(input_ids=ids(), labels=ids()).loss.backward()
    assert not [w for w in recwarn if "eval mode" in str(w.message)]


def test_hard_routing_asked_for_keeps_gradients_flowing_to_the_rest():
    # set_routing(model, "hard") is a choice, not eval mode's default: whatever else trains gets its gradients (the
    # routers none), as the fast path's gradient test relies on.
    model = get_peft_model(tiny_model("llama").eval(), focus_hf.FocusConfig(num_groups=4, window=2, sink_tokens=0))
    focus_hf.set_routing(model, "hard")
    model.enable_input_require_grads()
    embeddings = model.get_input_embeddings().weight.requires_grad_(True)
    model(input_ids=ids(), labels=ids()).loss.backward()
    assert embeddings.grad is not None and embeddings.grad.abs().sum() > 0


@pytest.mark.parametrize("modules_to_save", [None, ["lm_head"]])
def test_autocast_adapter_dtype_false_on_a_half_precision_base_is_refused(modules_to_save):
    model = tiny_model("llama").to(torch.bfloat16)
    before = snapshot(model)
    config = focus_hf.FocusConfig(num_groups=4, modules_to_save=modules_to_save)
    with pytest.raises(FocusConfigError, match="routers are always float32"):
        get_peft_model(model, config, autocast_adapter_dtype=False)
    assert_unmodified(model, before)
    assert "peft_config" not in model.__dict__
    peft_model = get_peft_model(model, focus_hf.FocusConfig(num_groups=4))  # the default casts: accepted
    with pytest.raises(FocusConfigError, match="routers are always float32"):
        peft_model.add_adapter("second", config, autocast_adapter_dtype=False)
    assert set(peft_model.peft_config) == {"default"}
    assert all("second" not in layer.focus_proj for layer in peft_model.modules() if isinstance(layer, FocusLayer))


# --- modules_to_save -------------------------------------------------------------------------------------------
def test_modules_to_save_trains_saves_reloads_and_deletes(tmp_path):
    model = get_peft_model(
        tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8, modules_to_save=["lm_head"])
    )
    assert isinstance(model.base_model.model.lm_head, ModulesToSaveWrapper)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "base_model.model.lm_head.modules_to_save.default.weight" in trainable
    original = model.base_model.model.lm_head.original_module.weight.detach().clone()
    train_one_step(model)
    trained = model.base_model.model.lm_head.modules_to_save["default"].weight
    assert not torch.equal(trained, original)  # the copy was trained
    assert torch.equal(model.base_model.model.lm_head.original_module.weight, original)  # the base was not
    expected = logits_of(model)
    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert torch.equal(saved["base_model.model.lm_head.weight"], trained)
    for logits in reloaded_logits(tmp_path / "adapter", "llama"):
        assert torch.equal(logits, expected)

    reloaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter")
    reloaded.delete_adapter("default")
    assert "default" not in reloaded.base_model.model.lm_head.modules_to_save
    reloaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter")
    with reloaded.disable_adapter():  # the base model: original lm_head, dense attention
        assert torch.equal(logits_of(reloaded), logits_of(tiny_model("llama")))
    # As with LoRA, unload() takes the routers out and keeps the trained copy of a module in modules_to_save.
    unloaded = reloaded.unload()
    assert isinstance(unloaded.lm_head, torch.nn.Linear) and torch.equal(unloaded.lm_head.weight, trained)
    assert not any(isinstance(m, (FocusLayer, ModulesToSaveWrapper)) for m in unloaded.modules())


def test_modules_to_save_tensors_are_checked(tmp_path):
    model = get_peft_model(
        tiny_model("llama"), focus_hf.FocusConfig(num_groups=4, window=8, modules_to_save=["lm_head"])
    )
    model.save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    for damage, message in (("drop", "missing 1 tensor"), ("nan", "NaN"), ("shape", "has shape")):
        broken = dict(tensors)
        if damage == "drop":
            del broken["base_model.model.lm_head.weight"]
        elif damage == "nan":
            broken["base_model.model.lm_head.weight"] = torch.full_like(broken["base_model.model.lm_head.weight"], 1)
            broken["base_model.model.lm_head.weight"][0, 0] = float("nan")
        else:
            broken["base_model.model.lm_head.weight"] = broken["base_model.model.lm_head.weight"][:, :5].contiguous()
        save_file(broken, weights)
        base = tiny_model("llama")
        before = snapshot(base)
        with pytest.raises(AdapterFileError, match=message):
            PeftModel.from_pretrained(base, tmp_path / "adapter")
        assert_unmodified(base, before)


def test_modules_to_save_cannot_name_a_routed_module():
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(FocusConfigError, match="both routed and saved"):
        get_peft_model(model, focus_hf.FocusConfig(num_groups=4, modules_to_save=["self_attn"]))
    assert_unmodified(model, before)


# --- layers_to_transform / layers_pattern ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("architecture", "options", "routed"),
    [
        ("llama", {"layers_to_transform": [1]}, ["model.layers.1.self_attn"]),
        ("llama", {"layers_to_transform": 0, "layers_pattern": "layers"}, ["model.layers.0.self_attn"]),
        ("gpt2", {"layers_to_transform": [1], "layers_pattern": ["h"]}, ["transformer.h.1.attn"]),
    ],
)
def test_layers_to_transform_round_trip(tmp_path, architecture, options, routed):
    model = get_peft_model(tiny_model(architecture), focus_hf.FocusConfig(num_groups=4, window=8, **options))
    names = [n.removeprefix("base_model.model.") for n, m in model.named_modules() if isinstance(m, FocusLayer)]
    assert names == routed
    assert model.peft_config["default"].num_routed_layers == 1
    train_one_step(model)
    expected = logits_of(model)
    model.save_pretrained(tmp_path / "adapter")
    for logits in reloaded_logits(tmp_path / "adapter", architecture):
        assert torch.equal(logits, expected)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layers_to_transform": [5]}, "selects none of the routable"),
        ({"layers_to_transform": [0], "layers_pattern": "blocks"}, "selects none of the routable"),
        ({"layers_pattern": "layers"}, "set layers_to_transform too"),
        ({"layers_to_transform": [0], "target_modules": ".*self_attn"}, "regex target_modules"),
        ({"layers_to_transform": [-1]}, "layer index >= 0"),
        ({"modules_to_save": "lm_head"}, "list of module names"),
        ({"init_weights": "gaussian"}, "true or false"),
    ],
)
def test_bad_peft_options_are_refused(options, message):
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(FocusConfigError, match=message):
        get_peft_model(model, focus_hf.FocusConfig(num_groups=4, **options))
    assert_unmodified(model, before)


# --- init_weights ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("init_weights", [True, False])
def test_init_weights_round_trip(tmp_path, init_weights):
    config = focus_hf.FocusConfig(num_groups=4, window=8, query_projection=True, init_weights=init_weights)
    model = get_peft_model(tiny_model("llama"), config)
    layer = next(m for m in model.modules() if isinstance(m, FocusLayer))
    same = torch.equal(layer.focus_query_proj["default"], layer.focus_proj["default"])
    assert same is init_weights  # True: queries start where their keys are filed; False: independent draws
    train_one_step(model)
    expected = logits_of(model)
    model.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["init_weights"] is init_weights
    for logits in reloaded_logits(tmp_path / "adapter", "llama"):
        assert torch.equal(logits, expected)


@pytest.mark.parametrize("options", [{"modules_to_save": ["lm_head"]}, {"layers_to_transform": [1]}])
def test_vllm_refuses_what_it_cannot_apply(tmp_path, options):
    from focus_hf.errors import FocusServingError
    from focus_hf.vllm.adapter import load_served_adapter

    base = tiny_model("llama")
    model = get_peft_model(base, focus_hf.FocusConfig(num_groups=4, window=8, **options))
    model.save_pretrained(tmp_path / "adapter")
    name = next(iter(options))
    with pytest.raises(FocusServingError, match=f"{name}="):
        load_served_adapter(str(tmp_path / "adapter"), "tiny", base.config)
