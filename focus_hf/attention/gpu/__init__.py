"""The GPU engine of hard-mode Focus attention: FlexAttention and variable-length flash attention behind one
convention (`kernels`), the block masks they read and the contract those keep (`block_masks`), the path that
composes them (`stock`), the paged copy of the keys that decoding reads (`paged_keys`), the kernels' CPU doubles
(`doubles`) and the check that shows a device exact before the path runs there (`verify`)."""
