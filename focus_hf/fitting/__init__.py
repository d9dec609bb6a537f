"""Fitting routers to a frozen base model: every way an adapter's weights and dense heads are chosen.

`capture` runs one dense pass of the base model and keeps what each routed layer saw and attended to; `distill`
fits each layer's router to that attention (`layerwise` does it one decoder layer at a time, for big bases) and
`parallel` shares the work between processes. `recall_audit` measures how much of the model's attention an
adapter keeps, `retrieval_heads` finds the heads that copy tokens from far back, and `dense_heads` picks the kv
heads that keep full attention from both audits. `trainer` is the other objective: the language-model loss through
transformers' `Trainer`. `metadata` is what both write about where an adapter came from.
"""
