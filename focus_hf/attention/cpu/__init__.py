"""The CPU engine of hard-mode Focus attention: the C kernels (`csrc/`, built by `build`, loaded by `native`, called
through `native_prefill` and `native_decode`), the partial results they
merge (`partials`), the group-sorted segments and copies they read (`segments`, `grouped_keys`), and the CPU path
that composes them (`cpu_path`: the own-group pass and the window band, decoding steps, the dense masked call)."""
