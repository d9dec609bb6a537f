"""The Focus attention: routing (causal Sinkhorn), the allowed-pair pattern, and the kernels that compute it.

`routing` sorts tokens into groups, `pattern` says which (query, key) pairs a routing allows, `reference` is the dense
masked oracle, `partials` / `cpu.cpu_path` (the CPU path) and `gpu.gpu_path` (the GPU path) compute hard mode from
sparse pieces on a `backends` kernel, and `function` is the attention function registered with transformers under the
name "focus".
"""
