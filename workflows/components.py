"""Start the long-lived workers of a run: as Ray actors in the run's placement groups
(`rlvr.run.placement`), or in-process.

The in-process mode uses the very same classes; it exists for the actor-overhead benchmark and for
debugging, never as the default.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.controller import NAMESPACE, ControllerActor, controller_name
from actors.generator import GeneratorActor
from actors.policy import PolicyActor
from actors.verifier import VerifierActor, VerifierPool
from rlvr.config import Config, ConfigError, ResourcesConfig
from rlvr.memory import jemalloc_active, preload_jemalloc
from rlvr.methods.base import build_method
from rlvr.run.placement import PlacementPlan, companions, plan_placement
from rlvr.training.rendezvous import LOOPBACK, run_addresses
from rlvr.training.settings import TrainerSettings
from workflows.generator_pool import GeneratorPool
from workflows.policy_group import PolicyGroup, rank_environments
from workflows.weight_sync import WeightSync, make_weight_sync
from workflows.workers import Worker

PLACEMENT_TIMEOUT_S = 60.0
log = logging.getLogger(__name__)


class ControllerClient:
    """Typed calls on the ControllerActor (`rlvr.run.controller.TrainingController`); every
    update carries its step and is applied at most once."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def plan_step(self, step: int, prompt_ids: list[str]) -> dict[str, Any]:
        return self.worker.run("plan_step", step, prompt_ids, step=step)

    def update_method_state(self, step: int, **observation: Any) -> Any:
        return self.worker.run("update_method_state", step, step=step, **observation)

    def observe_step(
        self,
        step: int,
        rewards_by_prompt: dict[str, list[float]],
        metrics: dict[str, Any],
        rollouts: list[dict[str, Any]],
    ) -> bool:
        return self.worker.run(
            "observe_step", step, rewards_by_prompt, metrics, rollouts, step=step
        )

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        return self.worker.run("state_dict", step=step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.worker.run("load_state_dict", state)


@dataclass
class Components:
    policy: PolicyGroup
    generator: GeneratorPool
    verifier: Any
    """VerifierPool (actors) or VerifierActor (in-process); both expose `score`."""
    controller: ControllerClient
    sync: WeightSync
    layout: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per model actor ("PolicyActor 0", "GeneratorActor 1"), the node, placement group and
    bundle it runs in."""
    _cleanup: list = field(default_factory=list)

    def shutdown(self) -> None:
        for fn in reversed(self._cleanup):
            fn()
        self._cleanup.clear()


def torch_threads(cfg: Config, concurrent: int = 1) -> int:
    """Torch threads per model actor: `resources.torch_threads`, else this machine's cores shared
    by the `concurrent` actors of one role that compute at once (policy ranks train together,
    engines generate together; the phases of a step take turns). With `run.max_staleness`
    the engines generate while the ranks train, so every rank and engine shares the cores
    (oversubscribed threads made the overlapped step 2x slower: bench/step_breakdown.py), and
    so do the engines' companions (Tandem's separate juniors)."""
    if cfg.run.max_staleness:
        concurrent = cfg.resources.policy_ranks + cfg.resources.generator_engines + companions(cfg)
    return cfg.resources.torch_threads or max(1, (os.cpu_count() or 1) // concurrent)


def trainer_settings(cfg: Config) -> TrainerSettings:
    """The policy trainer's settings from the run's config and its method."""
    t, lora = cfg.training, cfg.model.lora
    method = build_method(cfg)
    warmup, total = cfg.lr_schedule_steps()
    return TrainerSettings(
        zero_stage=t.zero_stage,
        lora=lora.settings() if lora.enabled else None,
        dtype=cfg.model.dtype,
        seed=cfg.run.seed,
        lr=t.lr,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        lr_schedule=t.lr_schedule,
        warmup_steps=warmup,
        total_steps=total,
        min_lr_ratio=t.min_lr_ratio,
        micro_batch_size=t.micro_batch_size,
        micro_batch_tokens=t.micro_batch_tokens,
        lm_head_chunk=t.lm_head_chunk,
        shared_prefix=t.shared_prefix,
        gradient_checkpointing=t.gradient_checkpointing,
        loss=method.policy_loss,
        loss_module=method.loss_module(),
        loss_options=method.loss_options(),
        loss_agg=t.loss_agg,
        kl_coef=method.kl_coef(),
        clip_low=t.clip_low,
        clip_high=t.clip_high,
        max_response_len=cfg.generation.max_tokens,
        mini_batches=t.mini_batches,
        epochs=t.epochs,
        temperature=cfg.generation.temperature,
        top_p=cfg.generation.top_p,
        engine_is=t.engine_is,
        engine_is_cap=t.engine_is_cap,
    )


def policy_kwargs(cfg: Config, model_dir: Path) -> dict[str, Any]:
    """A PolicyActor's arguments: the model, the trainer's settings and the process's resources."""
    return {
        "model_path": str(model_dir),
        "settings": trainer_settings(cfg),
        "threads": torch_threads(cfg, cfg.resources.policy_ranks),
        "mmap_threshold_kib": cfg.resources.malloc_mmap_threshold_kib,
    }


def generator_kwargs(cfg: Config, model_dir: Path, slot: int = 0) -> dict[str, Any]:
    """An engine's arguments; `slot`: its place among the run's engines and companion engines
    (engine i is slot i, its companion slot engines + i), which picks the cores a CPU vLLM
    engine binds its kernels to, a share of its own."""
    g = cfg.generation
    kw: dict[str, Any] = {
        "backend": g.backend,
        "model_path": str(model_dir),
        "dtype": cfg.engine_dtype,
    }
    threads = torch_threads(cfg, cfg.resources.generator_engines + companions(cfg))
    if g.backend == "vllm":
        kw.update(
            max_model_len=g.max_model_len,
            kv_cache_gib=g.kv_cache_gib,
            seed=cfg.run.seed,
            cpu_threads=threads,
            cpu_offset=slot * threads,
            enforce_eager=g.enforce_eager,
            engine_loop=g.engine_loop,
        )
        if cfg.resources.generator_tp > 1:
            kw["tensor_parallel_size"] = cfg.resources.generator_tp
        if cfg.resources.engines_sleep:  # vLLM's own sleep mode (GPUs)
            kw["enable_sleep_mode"] = True
    kw.update(build_method(cfg).generator_settings(model_dir))
    kw["threads"] = threads
    return kw


def companion_kwargs(cfg: Config, model_dir: Path, engine: int = 0) -> dict[str, Any]:
    """The arguments of engine `engine`'s companion (`Method.companion_engine`): an engine's,
    with the method's replacements (Tandem's separate junior: its weights and its role)."""
    kw = generator_kwargs(cfg, model_dir, slot=cfg.resources.generator_engines + engine)
    kw.update(build_method(cfg).companion_settings(model_dir))
    return kw


def jemalloc_library() -> Path:
    """The jemalloc shared library model actors preload: the file named by RAY_JEMALLOC_LIB_PATH
    (the variable Ray itself reads for its daemons), else the one bundled in Ray's wheel."""
    bundled = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    return Path(os.environ.get("RAY_JEMALLOC_LIB_PATH") or bundled)


def allocator_env(r: ResourcesConfig) -> dict[str, str]:
    """Environment variables of the model actors' processes for `resources.allocator` (none for
    glibc); a missing jemalloc library fails here, before any actor starts."""
    if r.allocator == "glibc":
        return {}
    try:
        return preload_jemalloc(jemalloc_library(), r.jemalloc_conf)
    except FileNotFoundError as err:
        raise ConfigError(
            f"resources.allocator: jemalloc: {err} (set RAY_JEMALLOC_LIB_PATH to a jemalloc "
            "shared library, or use allocator: glibc)"
        ) from err


def sleep_level(cfg: Config) -> int | None:
    """vLLM's sleep level while the policy trains, else None: engines colocated with their ranks
    on GPUs, and CPU engines, whose host memory the update shares (they free their KV cache:
    `VLLMBackend.sleep`), unless they sample during the update (run.max_staleness above 0)."""
    r = cfg.resources
    if cfg.generation.backend != "vllm" or r.engine_sleep == "off":
        return None
    cpu_engines = r.generator_gpus == 0 and cfg.run.max_staleness == 0
    if not (r.engines_sleep or cpu_engines):
        return None
    return {"offload": 1, "discard": 2}[r.engine_sleep]


def start_components(cfg: Config, model_dir: Path, use_actors: bool = True) -> Components:
    """The run's workers: `resources.policy_ranks` PolicyActors and `resources.generator_engines`
    GeneratorActors in the run's placement groups (in-process: one of each), the controller, the
    verifier pool, and the weight sync between policy and engines (`sync.transport`)."""
    mini_batches = cfg.training.mini_batches
    if not use_actors:
        if cfg.resources.allocator == "jemalloc" and not jemalloc_active():
            log.warning(
                "resources.allocator: jemalloc applies to actors; this in-process run keeps its "
                "process's allocator (start it with LD_PRELOAD=%s for jemalloc)",
                jemalloc_library(),
            )
        policy = PolicyGroup(
            [Worker(PolicyActor(**policy_kwargs(cfg, model_dir), address=LOOPBACK), "PolicyActor")],
            mini_batches,
        )
        companion = None
        if companions(cfg):
            companion = GeneratorActor(**companion_kwargs(cfg, model_dir))
        generator = GeneratorPool(
            [
                Worker(
                    GeneratorActor(
                        **generator_kwargs(cfg, model_dir),
                        mmap_threshold_kib=cfg.resources.malloc_mmap_threshold_kib,
                        address=LOOPBACK,
                        companion=companion,
                    ),
                    "GeneratorActor",
                )
            ]
        )
        return Components(
            policy=policy,
            generator=generator,
            verifier=VerifierActor(
                cfg.verifier.timeout_s,
                num_workers=cfg.verifier.num_workers,
                **cfg.verifier.verifier_kwargs(),
            ),
            controller=ControllerClient(
                Worker(
                    ControllerActor(
                        cfg.generation.group_size, build_method(cfg).controller_state()
                    ),
                    "ControllerActor",
                )
            ),
            sync=make_weight_sync(cfg, policy, generator),
        )

    r = cfg.resources
    model_env = allocator_env(r)
    plan = plan_placement(r, companions(cfg))
    groups = place_groups(cfg.run.name, plan)
    layout = placement_layout(groups, plan)
    addresses = run_addresses({name: where["node_ip"] for name, where in layout.items()})
    handles: list[Any] = []

    def model_actor(
        cls: type, name: str, where: tuple[int, int], cpus: float, gpus: float, kwargs: dict
    ):
        """A model-owning actor pinned to its bundle of the run's placement groups, in a process
        started with `model_env` (merged into the job's environment variables by Ray)."""
        group, bundle = where
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=groups[group], placement_group_bundle_index=bundle
        )
        env = {"runtime_env": {"env_vars": model_env}} if model_env else {}
        handle = (
            ray.remote(cls)
            .options(
                name=f"rlvr-{name}-{cfg.run.name}",
                namespace=NAMESPACE,
                num_cpus=cpus,
                num_gpus=gpus,
                scheduling_strategy=strategy,
                **env,
            )
            .remote(**kwargs)
        )
        handles.append(handle)
        return handle

    ranks = r.policy_ranks
    policy_workers = [
        Worker(
            model_actor(
                PolicyActor,
                "policy" if ranks == 1 else f"policy-{rank}",
                plan.policy[rank],
                r.policy_cpus,
                r.policy_gpus,
                {
                    **policy_kwargs(cfg, model_dir),
                    "distributed": env,
                    "address": addresses[f"PolicyActor {rank}"],
                },
            ),
            "PolicyActor" if ranks == 1 else f"PolicyActor {rank}",
        )
        for rank, env in enumerate(
            rank_environments(
                ranks, addresses["PolicyActor 0"], groups[plan.policy[0][0]], plan.policy[0][1]
            )
        )
    ]
    engines = r.generator_engines
    junior_workers = [
        Worker(
            model_actor(
                GeneratorActor,
                "junior" if engines == 1 else f"junior-{i}",
                plan.companion[i],
                r.generator_cpus,
                r.generator_gpus,
                {
                    **companion_kwargs(cfg, model_dir, i),
                    "mmap_threshold_kib": r.malloc_mmap_threshold_kib,
                },
            ),
            "JuniorEngine" if engines == 1 else f"JuniorEngine {i}",
        )
        for i in range(len(plan.companion))
    ]
    generator_workers = [
        Worker(
            model_actor(
                GeneratorActor,
                "generator" if engines == 1 else f"generator-{i}",
                plan.generator[i],
                r.generator_cpus,
                r.generator_gpus,
                {
                    **generator_kwargs(cfg, model_dir, slot=i),
                    "mmap_threshold_kib": r.malloc_mmap_threshold_kib,
                    "address": addresses[f"GeneratorActor {i}"],
                    "companion": junior_workers[i].target if junior_workers else None,
                },
            ),
            "GeneratorActor" if engines == 1 else f"GeneratorActor {i}",
        )
        for i in range(engines)
    ]
    controller = (
        ray.remote(ControllerActor)
        .options(
            name=controller_name(cfg.run.name), namespace=NAMESPACE, num_cpus=0, get_if_exists=False
        )
        .remote(cfg.generation.group_size, build_method(cfg).controller_state())
    )
    handles.append(controller)
    verifier = VerifierPool(
        r.num_verifiers,
        cfg.verifier.timeout_s,
        workers_per_actor=cfg.verifier.num_workers,
        cpus_per_actor=r.verifier_cpus,
        **cfg.verifier.verifier_kwargs(),
    )

    def cleanup() -> None:
        verifier.shutdown()
        for handle in handles:
            ray.kill(handle, no_restart=True)
        for group in groups:
            remove_placement_group(group)

    policy = PolicyGroup(policy_workers, mini_batches)
    generator = GeneratorPool(generator_workers, sleep_level(cfg))
    try:
        # Wait for the model actors to finish loading so a bad model fails here, named, not
        # mid-step.
        policy.ready()
        for junior in junior_workers:
            junior.run("ready")
        generator.ready()
        sync = make_weight_sync(cfg, policy, generator)
    except BaseException:
        cleanup()
        raise
    comps = Components(
        policy=policy,
        generator=generator,
        verifier=verifier,
        controller=ControllerClient(Worker(controller, "ControllerActor")),
        sync=sync,
        layout=layout,
    )
    comps._cleanup.append(cleanup)
    comps._cleanup.append(sync.close)
    return comps


def place_groups(run_name: str, plan: PlacementPlan) -> list[PlacementGroup]:
    """Ask Ray for the plan's placement groups and wait until all are placed; a layout the
    cluster cannot hold fails naming its bundles, with nothing left reserved."""
    groups = [
        placement_group(list(g.bundles), strategy=g.strategy, name=f"rlvr-{run_name}-{g.role}")
        for g in plan.groups
    ]
    try:
        ray.get([g.ready() for g in groups], timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        for group in groups:
            remove_placement_group(group)
        asked = "; ".join(f"{g.role}: {list(g.bundles)} ({g.strategy})" for g in plan.groups)
        raise RuntimeError(
            f"the cluster cannot place the actors' bundles ({asked}) within "
            f"{PLACEMENT_TIMEOUT_S:.0f}s; available: {ray.available_resources()}"
        ) from None
    return groups


def placement_layout(
    groups: list[PlacementGroup], plan: PlacementPlan
) -> dict[str, dict[str, Any]]:
    """Where the placement groups put each model actor: its node, group and bundle."""
    nodes = [ray.util.placement_group_table(g)["bundles_to_node_id"] for g in groups]
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    members = [(f"PolicyActor {r}", where) for r, where in enumerate(plan.policy)]
    members += [(f"GeneratorActor {i}", where) for i, where in enumerate(plan.generator)]
    members += [(f"JuniorEngine {i}", where) for i, where in enumerate(plan.companion)]
    out = {}
    for name, (group, bundle) in members:
        node = nodes[group][bundle]
        out[name] = {
            "node_id": node,
            "node_ip": addresses.get(node, ""),
            "group": plan.groups[group].role,
            "bundle": bundle,
        }
    return out
