"""Start the long-lived workers of a run: as Ray actors in one placement group, or in-process.

The in-process mode uses the very same classes; it exists for the actor-overhead benchmark and for
debugging, never as the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.controller import NAMESPACE, ControllerActor, controller_name
from actors.generator import GeneratorActor
from actors.policy import PolicyActor
from actors.verifier import VerifierActor, VerifierPool
from rlvr import tandem_rollouts
from rlvr.config import Config
from workflows.workers import Worker

PLACEMENT_TIMEOUT_S = 60.0


@dataclass
class Components:
    policy: Worker
    generator: Worker
    verifier: Any
    """VerifierPool (actors) or VerifierActor (in-process); both expose `score`."""
    controller: Worker
    _cleanup: list = field(default_factory=list)

    def shutdown(self) -> None:
        for fn in reversed(self._cleanup):
            fn()
        self._cleanup.clear()


def torch_threads(cfg: Config) -> int:
    return cfg.resources.torch_threads or os.cpu_count() or 1


def policy_kwargs(cfg: Config, model_dir: Path) -> dict[str, Any]:
    t, lora, dro = cfg.training, cfg.model.lora, cfg.algorithm.dro
    warmup, total = cfg.lr_schedule_steps()
    return {
        "model_path": str(model_dir),
        "zero_stage": t.zero_stage,
        "lora": lora.model_dump() if lora.enabled else None,
        "lr": t.lr,
        "weight_decay": t.weight_decay,
        "grad_clip": t.grad_clip,
        "micro_batch_size": t.micro_batch_size,
        "dtype": cfg.model.dtype,
        "seed": cfg.run.seed,
        "kl_coef": dro.beta if dro.enabled else t.kl_coef,
        "clip_low": t.clip_low,
        "clip_high": t.clip_high,
        "loss_agg": t.loss_agg,
        "temperature": cfg.generation.temperature,
        "mini_batches": t.mini_batches,
        "epochs": t.epochs,
        "engine_is": t.engine_is,
        "engine_is_cap": t.engine_is_cap,
        "lr_schedule": t.lr_schedule,
        "warmup_steps": warmup,
        "total_steps": total,
        "min_lr_ratio": t.min_lr_ratio,
        "max_response_len": cfg.generation.max_tokens,
        "loss": "dro" if dro.enabled else "grpo",
        "rho_ent": dro.rho_ent,
        "tandem": cfg.algorithm.tandem.enabled,
        "threads": torch_threads(cfg),
    }


def generator_kwargs(cfg: Config, model_dir: Path) -> dict[str, Any]:
    g = cfg.generation
    kw: dict[str, Any] = {
        "backend": g.backend,
        "model_path": str(model_dir),
        "dtype": cfg.model.dtype,
    }
    if g.backend == "vllm":
        kw.update(
            max_model_len=g.max_model_len,
            kv_cache_gib=g.kv_cache_gib,
            seed=cfg.run.seed,
            cpu_threads=torch_threads(cfg),
            enforce_eager=g.enforce_eager,
        )
    tandem = tandem_rollouts.generator_settings(cfg, model_dir)
    if tandem is not None:
        kw["tandem"] = tandem
    kw["threads"] = torch_threads(cfg)
    return kw


def start_components(cfg: Config, model_dir: Path, use_actors: bool = True) -> Components:
    if not use_actors:
        return Components(
            policy=Worker(PolicyActor(**policy_kwargs(cfg, model_dir)), "PolicyActor"),
            generator=Worker(GeneratorActor(**generator_kwargs(cfg, model_dir)), "GeneratorActor"),
            verifier=VerifierActor(cfg.verifier.timeout_s, num_workers=cfg.verifier.num_workers),
            controller=Worker(
                ControllerActor(
                    cfg.generation.group_size, cfg.laconic_dual(), cfg.duet_controller()
                ),
                "ControllerActor",
            ),
        )

    r = cfg.resources
    bundles = [
        {"CPU": r.policy_cpus, **({"GPU": r.policy_gpus} if r.policy_gpus else {})},
        {"CPU": r.generator_cpus, **({"GPU": r.generator_gpus} if r.generator_gpus else {})},
    ]
    pg = placement_group(bundles, strategy=r.placement_strategy, name=f"rlvr-{cfg.run.name}")
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(
            f"the cluster cannot place the actors' bundles {bundles} within {PLACEMENT_TIMEOUT_S:.0f}s; "
            f"available: {ray.available_resources()}"
        ) from None

    def model_actor(cls: type, role: str, bundle: int, cpus: float, gpus: float, kwargs: dict):
        """A model-owning actor pinned to its bundle of the run's placement group."""
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle
        )
        options = {"name": f"rlvr-{role}-{cfg.run.name}", "namespace": NAMESPACE, "num_cpus": cpus}
        return (
            ray.remote(cls)
            .options(**options, num_gpus=gpus, scheduling_strategy=strategy)
            .remote(**kwargs)
        )

    policy = model_actor(
        PolicyActor, "policy", 0, r.policy_cpus, r.policy_gpus, policy_kwargs(cfg, model_dir)
    )
    generator = model_actor(
        GeneratorActor,
        "generator",
        1,
        r.generator_cpus,
        r.generator_gpus,
        generator_kwargs(cfg, model_dir),
    )
    controller = (
        ray.remote(ControllerActor)
        .options(
            name=controller_name(cfg.run.name), namespace=NAMESPACE, num_cpus=0, get_if_exists=False
        )
        .remote(cfg.generation.group_size, cfg.laconic_dual(), cfg.duet_controller())
    )
    verifier = VerifierPool(
        r.num_verifiers,
        cfg.verifier.timeout_s,
        workers_per_actor=cfg.verifier.num_workers,
        cpus_per_actor=r.verifier_cpus,
    )
    comps = Components(
        policy=Worker(policy, "PolicyActor"),
        generator=Worker(generator, "GeneratorActor"),
        verifier=verifier,
        controller=Worker(controller, "ControllerActor"),
    )
    # Wait for the model actors to finish loading so a bad model fails here, named, not mid-step.
    comps.policy.run("ready")
    comps.generator.run("ready")

    def cleanup() -> None:
        verifier.shutdown()
        for handle in (policy, generator, controller):
            ray.kill(handle, no_restart=True)
        remove_placement_group(pg)

    comps._cleanup.append(cleanup)
    return comps
