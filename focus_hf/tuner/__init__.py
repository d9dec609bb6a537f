"""The PEFT tuner of Focus, laid out like peft's `tuners/<method>/`: `config` (FocusConfig), `layer` (the wrapper
around each attention module), `cache_state` (what a layer keeps on the KV cache), `model` (the BaseTuner),
`targets` (which modules of which architectures are routed), `controls` (run-time switches), `peft_type` and
`registration` (with PEFT and transformers). `loader_source` finds the adapter PEFT or transformers is loading
(checked before injection), `checked_weights` hands the checked tensors to the loaders' own reading steps (never a
pickle), `devices` where a module computes, and `dispatch` keeps routers on that device for accelerate-dispatched
bases.
"""

# Every tuner module builds on peft. Importing it here, before any of them runs, lets `import focus_hf` register
# Focus with PEFT (right after peft loads) while no tuner module is half-initialised.
import peft  # noqa: F401
