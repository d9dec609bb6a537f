"""The PEFT tuner of Focus, laid out like peft's `tuners/<method>/`: `config` (FocusConfig), `layer` (the wrapper
around each attention module), `cache_state` (what a layer keeps on the KV cache), `model` (the BaseTuner),
`targets` (which modules of which architectures are routed), `controls` (run-time switches). `patches` is every
change focus_hf makes to peft and transformers objects, in one table (registration, the loaders and saves wrapped);
`adapter_load` carries the adapter a loader is loading (checked before injection, its checked tensors handed to the
loaders' own reading steps, never a pickle); `devices` says where a module computes, and `dispatch` keeps routers on
that device for accelerate-dispatched bases.
"""

# Every tuner module builds on peft. Importing it here, before any of them runs, lets `import focus_hf` register
# Focus with PEFT (right after peft loads) while no tuner module is half-initialised.
import peft  # noqa: F401
