"""The defaults of `FocusConfig`, readable without importing peft (the CLI prints them in `--help`)."""

ROUTING_MODES = ("auto", "soft", "hard")

FOCUS_DEFAULTS = {
    "num_groups": 8,
    "group_dim": 16,
    "window": 128,
    "top_k": 2,
    "probe_mass": None,
    "sink_tokens": 4,
    "temperature": 0.1,
    "sinkhorn_iterations": 10,
    "routing_mode": "auto",
    "gate_floor": 1e-6,
}
