"""What the benchmarks share: `records` says where, when and how a row was measured (the machine, the versions, the
commit, the command) and writes rows as they come, `timing` times calls, `layer` builds one attention layer's inputs
and calls, and `model` holds the whole-model helpers (held-out text, variants, the timed `generate()`).

`focus-hf bench` and the scripts under `benchmarks/` import these modules; nothing else in the package does.
"""
