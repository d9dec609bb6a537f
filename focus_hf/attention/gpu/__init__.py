"""The GPU path of hard-mode Focus attention: FlexAttention and variable-length flash attention behind one
convention (`kernels`), the block masks they read and the contract those keep (`block_masks`), the path that
composes them (`gpu_path`: the own-group pass and the window band), the paged copy of the keys that decoding reads
(`paged_keys`), the CPU stand-ins of the CUDA kernels (`cpu_standins`) and the check that shows a device exact before
the path runs there (`verify`)."""
