"""rlvr: Ray-native reinforcement learning from verifiable rewards, and certified serving.

The public Python API, what a notebook or a script drives:

    import rlvr

    cfg = rlvr.load_config("tiny", {"run.steps": 4})     # a preset (or YAML file) + overrides
    run = rlvr.train(cfg, background=True)                # or rlvr.train(cfg): in the foreground
    for step in run:                                      # each step's metrics as it commits
        print(step["step"], step["reward_mean"])
    summary = run.wait()
    rlvr.evaluate(run.run_dir, n=4)                       # accuracy, pass@k, lengths
    rlvr.serve("serve-tiny", background=True)             # the CSA-gated OpenAI API

`load_config`, `Config`, `ServeConfig`, `ConfigError`: the configs and the error every bad
input raises; `train`, `TrainingRun`, `evaluate`, `serve`, `Deployment`, `RunStopped`: running
them (`workflows.api`).

Every name is resolved on first use (PEP 562: this module's `__getattr__` imports the module that
defines it, by name, with importlib). So `import rlvr` imports nothing else: the library below it
stays importable and testable without Ray, and the Ray side (`workflows`, `actors`) loads only
when a name that needs it is used. It is also why this package may expose functions defined in
`workflows`: the project's imports run downward only (the library never imports the workflows
that drive it, nor Ray), and a lookup by name at call time is not an import of the package.
"""

import importlib as _importlib

_PUBLIC = {
    "Config": "rlvr.config",
    "ConfigError": "rlvr.config",
    "load_config": "rlvr.config",
    "ServeConfig": "rlvr.serving.config",
    "train": "workflows.api",
    "TrainingRun": "workflows.api",
    "evaluate": "workflows.api",
    "serve": "workflows.api",
    "Deployment": "workflows.api",
    "RunStopped": "workflows.stopping",
}
"""Each public name and the module that defines it."""

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> object:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'rlvr' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({n for n in globals() if not n.startswith("_")} | set(__all__))
