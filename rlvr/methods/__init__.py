"""Training methods as the step loop runs them: one package per method with its hooks, its
shaping, its config section, its checks and its controller state (`base` defines the hooks and
the registry). The equations each one implements live below, in `rlvr.algorithms`."""
