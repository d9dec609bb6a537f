"""The CPU engine of hard-mode Focus attention: the C kernels (`csrc/`, built by `native`), the partial results they
merge (`partials`), the group-sorted segments and copies they read (`segments`, `grouped_keys`), and the fast path
that composes them (`fast`)."""
