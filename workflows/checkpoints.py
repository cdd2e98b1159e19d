"""What `rlvr train` writes, as models: find a run directory, resolve a run, HF directory,
adapter or step checkpoint to a loadable HF directory, and export a step checkpoint
(`rlvr export`)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from rlvr.config import Config, ConfigError, config_from_dict, load_config
from rlvr.models import cache_dir, resolve_model_path
from rlvr.run.rundir import STEP_PREFIX, RunDir
from rlvr.verifiers.worker import names_an_object

# --- checkpoints ----------------------------------------------------------------------------------


def find_run_dir(path: Path) -> Path | None:
    """The run directory holding `path` (itself or the nearest parent with a config.yaml)."""
    for d in (path, *path.parents):
        if (d / "config.yaml").is_file() and (d / "checkpoints").is_dir():
            return d
    return None


def load_run_config(run_dir: Path) -> Config:
    """The config the run at `run_dir` was started with (its config.yaml); ConfigError where it
    names reward functions, tools or an environment class passed as Python objects, which the
    file cannot hold: only the `Config` holding them gives them again."""
    data = RunDir(run_dir).load_config_dict()
    objects = sorted({v for v in _strings(data) if names_an_object(v)})
    if objects:
        raise ConfigError(
            f"{run_dir} was started with Python objects ({', '.join(objects)}), which its "
            "config.yaml names but cannot hold: give the Config that holds them "
            "(rlvr.train(config, resume=RUN_DIR), rlvr.evaluate(..., config=config))"
        )
    return config_from_dict(data)


def _strings(tree: object) -> list[str]:
    """Every str in nested dicts and lists."""
    if isinstance(tree, str):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else []
    return [s for value in values for s in _strings(value)]


def run_config(path: Path, config: Config | str | Path | None) -> tuple[Config, Path | None]:
    """(the config to evaluate `path` under, its run directory): `config` when given (a Config,
    or a YAML file or preset to load), else the config of the run holding `path`; ConfigError
    outside a run without one."""
    run_dir = find_run_dir(path)
    if isinstance(config, Config):
        return config, run_dir
    if config is not None:
        return load_config(config), run_dir
    if run_dir is not None:
        return load_run_config(run_dir), run_dir
    raise ConfigError("invalid evaluation input: --config is needed outside a run directory")


def resolve_checkpoint(spec: str | Path, base_dir: Path, cfg: Config) -> Path:
    """An HF model directory for what `rlvr train` wrote: a run directory (its `final/`), an HF
    directory (`final/`, merged weights), a PEFT adapter directory (merged into `base_dir`), or a
    step checkpoint `checkpoints/step_N` (the run `cfg`'s trainer state, exported once into the
    model cache)."""
    path = Path(spec).expanduser()
    if (path / "final" / "config.json").is_file():
        path = path / "final"
    if (path / "config.json").is_file():
        return resolve_model_path(str(path))
    if (path / "adapter_config.json").is_file():
        from rlvr.models.checkpoints import merge_adapter

        return merge_adapter(base_dir, path)
    if (path / "policy" / "latest").is_file():
        return _convert_step_checkpoint(path / "policy", base_dir, cfg)
    raise FileNotFoundError(
        f"checkpoint {spec!r} is neither a run directory, an HF model, an adapter nor a step "
        "checkpoint"
    )


def _convert_step_checkpoint(state_dir: Path, base_dir: Path, cfg: Config) -> Path:
    """The HF directory of a step checkpoint's policy, written once into the model cache by the
    trainer's own resume-and-export path (the same merge as a run's `final/`)."""
    from actors.policy import PolicyActor
    from rlvr.models.tiny import publish_dir, staging_dir
    from workflows.components import policy_kwargs

    files = sorted(f for f in state_dir.rglob("*") if f.is_file())
    digest = hashlib.sha256(str(base_dir.resolve()).encode())
    for f in files:
        digest.update(
            f"{f.relative_to(state_dir)}\0{f.stat().st_size}\0{f.stat().st_mtime_ns}".encode()
        )
    out = cache_dir() / "models" / f"step-{state_dir.parent.name}-{digest.hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    policy = PolicyActor(**policy_kwargs(cfg, base_dir))
    policy.load_state(str(state_dir))
    staging = staging_dir(out)
    policy.save_model(str(staging))
    return publish_dir(staging, out)


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """`rlvr export`: write a run's checkpoint as a loadable HF directory at `out`: merged
    weights and tokenizer, plus `adapter/` with LoRA. `checkpoint` is a step checkpoint or a run
    directory (its newest intact step); ConfigError for anything else or an existing `out`."""
    from workflows.train import prepare

    path, target = Path(checkpoint).expanduser(), Path(out).expanduser()
    run_dir = find_run_dir(path)
    if run_dir is None:
        raise ConfigError(f"invalid export input: {path} is not in a run directory")
    run = RunDir(run_dir)
    if path.resolve() == run_dir.resolve():
        step = run.last_intact_step()
        if step is None:
            raise ConfigError(f"invalid export input: {run_dir} has no committed step")
        path = run.step_dir(step)
    if not (path / "policy" / "latest").is_file():
        raise ConfigError(f"invalid export input: {path} is not a step checkpoint")
    damage = run.checkpoint_damage(int(path.name.removeprefix(STEP_PREFIX)))
    if damage is not None:
        raise ConfigError(f"invalid export input: {path} is damaged ({damage})")
    if target.exists():
        raise ConfigError(f"invalid export input: {target} exists; choose a new directory")
    cfg = load_run_config(run_dir)
    base_dir = prepare(cfg)[0]
    converted = _convert_step_checkpoint(path / "policy", base_dir, cfg)
    shutil.copytree(converted, target)
    return target
