"""The PEFT tuner of Focus, laid out like peft's `tuners/<method>/`: `config` (FocusConfig; its defaults in
`defaults`), `layer` (the wrapper around each attention module), `model` (the BaseTuner), `targets` (which modules
of which architectures are routed), `controls` (run-time switches), `peft_type` and `registration` (with PEFT and
transformers, run by `import focus_hf`).

Nothing is imported here, so that `focus_hf.tuner.defaults` stays light; import from the modules.
"""
