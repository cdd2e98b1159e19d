"""Durable GRPO training workflow over long-lived actors.

One step is a short sequence of named phases (plan, generate, score, shape, update, sync, observe,
persist), each one call on a long-lived actor. A step is completed when its checkpoint is committed
in the run directory; `resume` continues after the last completed step with the same data order,
sampling seeds, weights, optimizer and controller state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from rlvr.algorithms import duet_control, dynamic_sampling, laconic
from rlvr.config import Config, ConfigError, check_model_for_backend, config_from_dict
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.metrics import group_stats, rollout_stats
from rlvr.models import cache_dir, resolve_model_path
from rlvr.models.sft import sft_warmup
from rlvr.rollouts import Rollouts, shape_duet, shape_grpo
from rlvr.rundir import RunDir, atomic_write_text
from rlvr.tandem_rollouts import shape_tandem
from rlvr.tasks import load_task
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import render_prompt
from rlvr.tasks.sampler import PromptSampler
from rlvr.training.batch import rows_that_train
from workflows.components import Components, start_components
from workflows.dro_step import DroStep

log = logging.getLogger(__name__)

EVAL_SEED = 1234
REQUEST_SEED_STRIDE = 10_007


def sampling_seed(run_seed: int, step: int) -> int:
    """Per-step sampling seed: a resumed step samples exactly what the uninterrupted one did."""
    return (run_seed * 1_000_003 + step * 7919) % (2**31 - 1)


def best_metric(cfg: Config) -> str:
    """The held-out metric that picks the best checkpoint (higher is better for every method).

    Tandem selects on the accuracy of tandem rollouts, not solo ones (arXiv:2606.28166, section
    5.1); DRO on the validation reward, held-out mean R3 (arXiv:2506.13351, App. F.2); every other
    method on held-out accuracy.
    """
    if cfg.algorithm.tandem.enabled:
        return "eval_tandem_accuracy"
    if cfg.algorithm.dro.enabled:
        return "eval_r3"
    return "eval_accuracy"


@dataclass
class Trainer:
    """Drives the step loop for one run directory."""

    cfg: Config
    run: RunDir
    comps: Components
    tokenizer: Any
    train_problems: list[Problem]
    test_problems: list[Problem]
    dro: DroStep | None = None
    """DRO's score / shape / evaluate phases when algorithm.dro.enabled."""

    def __post_init__(self) -> None:
        self.sampler = PromptSampler(
            self.train_problems, self.cfg.generation.prompts_per_step, self.cfg.run.seed
        )
        self._prompt_cache: dict[str, list[int]] = {}

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The problem's prompt ids as every pass renders them (task.instruction, chat_template)."""
        if problem.id not in self._prompt_cache:
            task = self.cfg.task
            self._prompt_cache[problem.id] = render_prompt(
                self.tokenizer, problem, task.instruction, task.chat_template
            )
        return self._prompt_cache[problem.id]

    # --- phases ---------------------------------------------------------------------------------
    def generate(
        self,
        problems: list[Problem],
        n: dict[str, int],
        params: SamplingParams,
        step: int,
        duet_stop: dict[str, Any] | None = None,
        tandem: bool = False,
        first_index: int = 0,
    ) -> Rollouts:
        """Sample n[id] responses per problem; `duet_stop` runs DUET's stop rule in the engine;
        `tandem` co-writes every response with the frozen junior. `first_index` is the step-wide
        index of the first problem (DAPO's refill rounds continue the step's seed streams)."""
        base = params.seed if params.seed is not None else 0
        # each prompt its own seed stream: sample j of prompt i draws from base + STRIDE * i + j
        requests = [
            GenerationRequest(
                self.prompt_ids(p),
                n=n[p.id],
                request_id=p.id,
                seed=base + REQUEST_SEED_STRIDE * (first_index + i),
            )
            for i, p in enumerate(problems)
        ]
        extra = {"duet_stop": duet_stop} if duet_stop is not None else {}
        if tandem:
            extra["tandem"] = True
        results = self.comps.generator.run("generate", requests, params, step=step, **extra)
        return Rollouts.from_results(results, {p.id: p.answer for p in problems})

    def score(self, rollouts: Rollouts) -> None:
        scored = self.comps.verifier.score(rollouts.texts, rollouts.golds)
        rollouts.rewards = np.array([r for r, _ in scored], dtype=np.float64)
        rollouts.statuses = [s for _, s in scored]

    def evaluate(self, step: int) -> dict[str, Any]:
        """Held-out mean@k accuracy and mean response length of the policy alone, the method's
        validation metric beside them, and the name of the one that picks the best checkpoint.

        Tandem adds the accuracy of tandem rollouts (the frozen junior co-writing as in training,
        same sampling as the solo pass); DRO the held-out reference certainty of `group_size`
        rollouts per query drawn with the training sampler (mean R3, `DroStep.evaluate`).
        """
        g = self.cfg.generation
        params = SamplingParams(
            temperature=g.eval_temperature, top_p=1.0, max_tokens=g.max_tokens, seed=EVAL_SEED
        )
        k = g.eval_samples
        n = {p.id: k for p in self.test_problems}
        t0 = time.perf_counter()
        rollouts = self.generate(self.test_problems, n, params, step)
        self.score(rollouts)
        record = {
            "step": step,
            "eval_accuracy": float(np.mean(rollouts.rewards >= 1.0)),
            "eval_reward": float(np.mean(rollouts.rewards)),
            "eval_length_mean": float(np.mean(rollouts.lengths)),
            "eval_problems": len(self.test_problems),
            "eval_samples": k,
        }
        if self.cfg.algorithm.tandem.enabled:
            tandem = self.generate(self.test_problems, n, params, step, tandem=True)
            self.score(tandem)
            record["eval_tandem_accuracy"] = float(np.mean(tandem.rewards >= 1.0))
            record["eval_tandem_length_mean"] = float(np.mean(tandem.lengths))
        if self.dro is not None:
            groups = {p.id: g.group_size for p in self.test_problems}
            train_params = SamplingParams(
                temperature=g.temperature, top_p=g.top_p, max_tokens=g.max_tokens, seed=EVAL_SEED
            )
            record.update(
                self.dro.evaluate(self.generate(self.test_problems, groups, train_params, step))
            )
        record["eval_seconds"] = time.perf_counter() - t0
        record["best_metric"] = best_metric(self.cfg)
        self.run.append_eval(record)
        return record

    def step(self, step: int) -> dict[str, Any]:
        """Run one training step and return its metrics (not yet persisted)."""
        cfg, comps = self.cfg, self.comps
        times: dict[str, float] = {}
        t_start = time.perf_counter()
        problems = self.sampler.batch(step)

        t = time.perf_counter()
        plan = comps.controller.run("plan_step", step, [p.id for p in problems], step=step)
        times["time_plan"] = time.perf_counter() - t
        duet_plan = plan.get("duet")
        duet_stop = (
            cfg.duet_stop(duet_plan["k1"], duet_plan["k2"], step) if duet_plan is not None else None
        )
        params = SamplingParams(
            temperature=cfg.generation.temperature,
            top_p=cfg.generation.top_p,
            max_tokens=cfg.generation.max_tokens,
            seed=sampling_seed(cfg.run.seed, step),
        )
        dapo_stats: dict[str, Any] = {}
        if cfg.algorithm.dynamic_sampling.enabled:
            rollouts, trained, dapo_stats = self.collect_dynamic(problems, params, step, times)
        else:
            t = time.perf_counter()
            rollouts = self.generate(
                problems, plan["n"], params, step, duet_stop, tandem=cfg.algorithm.tandem.enabled
            )
            times["time_generate"] = time.perf_counter() - t

            t = time.perf_counter()
            if self.dro is not None:
                self.dro.score(rollouts, step)  # R3 on the rollout weights, before the sync
            else:
                self.score(rollouts)
            times["time_verify"] = time.perf_counter() - t
            trained = rollouts

        batch, shape_stats = self.shape(trained, plan, step) if len(trained) else (None, {})

        t = time.perf_counter()
        if batch is not None and batch.num_loss_tokens:
            rows = rows_that_train(batch, cfg.training.loss_agg, self.dro is not None)
            train_stats = comps.policy.run(
                "train_step",
                batch if len(rows) == len(batch) else batch.select(rows),
                logprob_sums=duet_plan is not None,
                step=step,
            )
            train_stats["rows"] = len(rows)
            if "logprob_sums" in train_stats:
                sums = [0.0] * len(batch)  # rows left out had no loss token: no surrogate use
                for row, value in zip(rows, train_stats["logprob_sums"], strict=True):
                    sums[row] = value
                train_stats["logprob_sums"] = sums
        else:
            # DUET aborted every rollout, or DAPO found no informative group: no loss token
            log.warning("step %d: no rollout carries a loss token; the update is skipped", step)
            train_stats = {"skipped": 1, "logprob_sums": [0.0] * len(trained)}
        logprob_sums = train_stats.pop("logprob_sums", None)
        times["time_train"] = time.perf_counter() - t

        t = time.perf_counter()
        self.sync_weights(step)
        times["time_sync"] = time.perf_counter() - t

        metrics: dict[str, Any] = {"step": step, "epoch": self.sampler.epoch_of(step)}
        metrics.update(rollout_stats(rollouts.rewards, rollouts.lengths, rollouts.finish_reasons))
        metrics.update(group_stats(rollouts.rewards, rollouts.group_ids))
        metrics.update(shape_stats)
        metrics.update(dapo_stats)
        metrics.update({f"train_{k}": v for k, v in train_stats.items()})
        if duet_plan is not None:
            t = time.perf_counter()
            metrics.update(self.observe_duet(rollouts, step, logprob_sums))
            times["time_duet_state"] = time.perf_counter() - t
        total = time.perf_counter() - t_start
        metrics.update(times)
        metrics["time_step"] = total
        metrics["time_overhead"] = total - sum(times.values())
        metrics["tokens_per_s"] = metrics["tokens_generated"] / max(times["time_generate"], 1e-9)

        comps.controller.run(
            "observe_step",
            step,
            rollouts.rewards_by_group(),
            _json_safe(metrics),
            rollouts.records(step, limit=cfg.generation.prompts_per_step * 2),
            step=step,
        )
        self._last_rollouts = rollouts
        return metrics

    def collect_dynamic(
        self, problems: list[Problem], params: SamplingParams, step: int, times: dict[str, float]
    ) -> tuple[Rollouts, Rollouts, dict[str, Any]]:
        """DAPO dynamic sampling: generate and score groups, drop the all-equal ones, and refill
        with fresh prompts until the step holds `len(problems)` informative groups or
        `max_rounds` rounds ran. Returns (every generated rollout, the kept groups' rollouts,
        metrics); generation and verification seconds add up in `times`."""
        ds, group_size = self.cfg.algorithm.dynamic_sampling, self.cfg.generation.group_size
        index = {p.id: i for i, p in enumerate(self.train_problems)}
        drawn, batch = list(problems), list(problems)
        rounds: list[Rollouts] = []
        kept: list[str] = []
        dropped = 0
        times["time_generate"] = times["time_verify"] = 0.0
        for r in range(ds.max_rounds):
            t = time.perf_counter()
            part = self.generate(
                batch,
                {p.id: group_size for p in batch},
                params,
                step,
                first_index=len(drawn) - len(batch),
            )
            times["time_generate"] += time.perf_counter() - t
            t = time.perf_counter()
            self.score(part)
            times["time_verify"] += time.perf_counter() - t
            rounds.append(part)
            outcome = dynamic_sampling.sift_round(
                part.rewards, part.group_ids, len(kept), len(problems), r, ds.max_rounds
            )
            kept += outcome.kept
            dropped += len(outcome.dropped)
            idx = dynamic_sampling.refill_indices(
                len(self.train_problems),
                outcome.refill,
                [index[p.id] for p in drawn],
                self.cfg.run.seed,
                step,
                r + 1,
            )
            if not idx:
                break
            batch = [self.train_problems[i] for i in idx]
            drawn += batch
        every = Rollouts.concat(rounds)
        stats = {
            "dapo_rounds": len(rounds),
            "dapo_kept_groups": len(kept),
            "dapo_dropped_groups": dropped,
        }
        return every, every.take(every.rows_of(kept)), stats

    def shape(
        self, rollouts: Rollouts, plan: dict[str, Any], step: int
    ) -> tuple[Any, dict[str, Any]]:
        """Advantages and the training batch; LACONIC first turns rewards into its Lagrangian,
        DUET weights them and masks aborted rollouts out; DRO keeps the rubric-accepted groups."""
        if self.dro is not None:
            return self.dro.shape(rollouts)
        if self.cfg.algorithm.tandem.enabled:
            return shape_tandem(rollouts, self.cfg, pad_id=self.tokenizer.pad_token_id)
        if "duet" in plan:
            du = self.cfg.algorithm.duet
            batch, stats = shape_duet(
                rollouts, plan["duet"]["counts"], self.cfg, pad_id=self.tokenizer.pad_token_id
            )
            stats.update(
                duet_control.step_metrics(
                    plan["duet"],
                    rollouts.flags,
                    rollouts.weights,
                    rollouts.lengths,
                    du.n_min,
                    du.n_max,
                )
            )
            return batch, stats
        lam = plan.get("laconic_lambda")
        if lam is None:
            return shape_grpo(rollouts, self.cfg, pad_id=self.tokenizer.pad_token_id)
        lc = self.cfg.algorithm.laconic
        lengths = np.asarray(rollouts.lengths)
        shaped = laconic.lagrangian_rewards(rollouts.rewards, lengths, lc.budget, lam, lc.cost)
        batch, stats = shape_grpo(
            rollouts, self.cfg, pad_id=self.tokenizer.pad_token_id, rewards=shaped
        )
        # the dual sees every response of the step, before any filtering
        lam_next = self.comps.controller.run(
            "update_length_dual", step, float(lengths.mean()), step=step
        )
        truncated = [f == "length" for f in rollouts.finish_reasons]
        stats.update(
            laconic.step_metrics(
                rollouts.rewards, lengths, truncated, lc.budget, lam, lam_next, lc.cost
            )
        )
        return batch, stats

    def observe_duet(
        self, rollouts: Rollouts, step: int, logprob_sums: list[float]
    ) -> dict[str, Any]:
        """Fold the step's rollouts into DUET's per-prompt state and K1/K2 window (once)."""
        kept = [not f.get("aborted", False) for f in rollouts.flags]
        epoch_end = self.sampler.epoch_of(step + 1) > self.sampler.epoch_of(step)
        return self.comps.controller.run(
            "update_duet_state",
            step,
            rollouts.group_ids,
            rollouts.advantages.tolist(),
            logprob_sums,
            rollouts.lengths,
            kept,
            epoch_end,
            step=step,
        )

    def sync_weights(self, step: int | None = None) -> None:
        """Push the policy's current weights into every engine without restarting them."""
        self.comps.sync.push(step)

    def persist(self, step: int, metrics: dict[str, Any], best_step: int | None) -> None:
        """Commit step `step`: its log lines, then policy + optimizer and controller state.

        Logs go first: a crash before the checkpoint commits leaves lines that resume truncates,
        while the reverse order could lose a committed step's lines for good.
        """
        self.run.append_metrics(_json_safe(metrics))
        self.run.append_rollouts(self._last_rollouts.records(step))
        with self.run.writing_checkpoint(step) as d:
            self.comps.policy.run("save_state", str(d / "policy"), step=step)
            state = self.comps.controller.run("state_dict", step=step)
            atomic_write_text(d / "controller.json", json.dumps(state))
            progress = {
                "step": step,
                "best_step": best_step,
                "best_metric": best_metric(self.cfg),
            }
            atomic_write_text(d / "progress.json", json.dumps(progress))
        self.run.prune(self.cfg.run.keep_last, keep={best_step} if best_step is not None else set())

    def restore(self, step: int) -> int | None:
        """Load the committed state of step `step`; returns the best step recorded there.

        The best step was picked by the metric recorded with it, which must be this run's.
        """
        d = self.run.step_dir(step)
        progress = json.loads((d / "progress.json").read_text())
        key = best_metric(self.cfg)
        if progress.get("best_metric", key) != key:
            raise ConfigError(
                f"{self.run.path} picked its best checkpoint by {progress['best_metric']}, "
                f"this configuration by {key}"
            )
        self.comps.policy.run("load_state", str(d / "policy"))
        self.comps.controller.run(
            "load_state_dict", json.loads((d / "controller.json").read_text())
        )
        return progress["best_step"]


def _json_safe(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


def prepare(cfg: Config) -> tuple[Path, list[Problem], list[Problem]]:
    """Everything that can fail on bad input, done before any actor starts."""
    try:
        model_dir = resolve_model_path(cfg.model.path, seed=cfg.model.seed)
    except FileNotFoundError as err:
        raise ConfigError(f"invalid config: model.path: {err}") from None
    check_model_for_backend(cfg, model_dir)
    try:
        train_problems, test_problems = load_task(cfg.task)
    except ValueError as err:
        raise ConfigError(f"invalid config: task: {err}") from None
    if not train_problems:
        raise ConfigError("invalid config: task: the training set is empty")
    if not test_problems:
        raise ConfigError("invalid config: task: the held-out set is empty")
    from transformers import AutoTokenizer

    try:
        task = cfg.task
        render_prompt(
            AutoTokenizer.from_pretrained(model_dir),
            train_problems[0],
            task.instruction,
            task.chat_template,
        )
    except ValueError as err:
        raise ConfigError(f"invalid config: {err}") from None
    if cfg.model.sft_warmup_steps:
        # one cache entry per (model, steps, task): switching presets never rebuilds another's
        task_key = hashlib.sha1(
            json.dumps(cfg.task.model_dump(mode="json"), sort_keys=True).encode()
        )
        name = f"{model_dir.name}-sft{cfg.model.sft_warmup_steps}-{task_key.hexdigest()[:10]}"
        out = cache_dir() / "models" / name
        model_dir = sft_warmup(
            model_dir,
            train_problems,
            out,
            steps=cfg.model.sft_warmup_steps,
            instruction=cfg.task.instruction,
            chat_template=cfg.task.chat_template,
        )
    return model_dir, train_problems, test_problems


def train(
    cfg: Config,
    run_path: Path,
    resume: bool = False,
    use_actors: bool = True,
    prepared: tuple[Path, list[Problem], list[Problem]] | None = None,
) -> dict[str, Any]:
    """Train (or resume) the run at `run_path`; returns the final summary.

    `prepared` is `prepare(cfg)`'s result when the caller validated the inputs before Ray started.
    """
    from torch.utils.tensorboard import SummaryWriter
    from transformers import AutoTokenizer

    run = RunDir(run_path)
    model_dir, train_problems, test_problems = prepared or prepare(cfg)
    if not resume:
        if run.completed_steps():
            raise ConfigError(f"{run_path} already holds a run; use --resume or another run.name")
        run.create(cfg.to_dict())

    last = run.last_completed_step() if resume else None
    start = 0 if last is None else last + 1
    run.truncate_logs_after(last if last is not None else -1)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    comps = start_components(cfg, model_dir, use_actors=use_actors)
    if comps.layout:
        atomic_write_text(run.path / "layout.json", json.dumps(comps.layout, indent=1))
    dro_step = None
    if cfg.algorithm.dro.enabled:
        try:
            dro_step = DroStep.start(
                cfg,
                model_dir,
                comps,
                tokenizer,
                train_problems,
                test_problems,
                use_actors=use_actors,
                history=run.read_metrics(),
            )
        except BaseException:
            comps.shutdown()
            raise
    trainer = Trainer(cfg, run, comps, tokenizer, train_problems, test_problems, dro=dro_step)
    writer = SummaryWriter(str(run.tb_dir), purge_step=start)
    try:
        key = best_metric(cfg)
        best_step, best_value = None, None
        if last is not None:
            best_step = trainer.restore(last)
            trainer.sync_weights()
            evals = {r["step"]: r for r in run.read_eval()}
            best_value = evals.get(best_step, {}).get(key)
        else:
            before = trainer.evaluate(step=-1)
            _log_scalars(writer, before, -1)
        bar = tqdm(
            range(start, cfg.run.steps),
            initial=start,
            total=cfg.run.steps,
            desc=cfg.run.name,
            unit="step",
        )
        for step in bar:
            metrics = trainer.step(step)
            is_last = step == cfg.run.steps - 1
            if is_last or (cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0):
                ev = trainer.evaluate(step)
                metrics.update(ev)
                if best_value is None or ev[key] > best_value:
                    best_value, best_step = ev[key], step
            trainer.persist(step, metrics, best_step)
            _log_scalars(writer, metrics, step)
            bar.set_postfix(
                reward=f"{metrics['reward_mean']:.3f}",
                acc=f"{metrics['accuracy']:.3f}",
                tok_s=f"{metrics['tokens_per_s']:.0f}",
            )
        comps.policy.run("save_model", str(run.final_model))
        tokenizer.save_pretrained(run.final_model)
        evals = run.read_eval()
        summary = {
            "run_dir": str(run_path),
            "steps": cfg.run.steps,
            "eval_before": next((e for e in evals if e["step"] == -1), None),
            "eval_after": evals[-1] if evals else None,
            "best_step": best_step,
            "best_metric": key,
            "final_model": str(run.final_model),
        }
        atomic_write_text(run.path / "summary.json", json.dumps(summary, indent=2))
        return summary
    finally:
        writer.close()
        comps.shutdown()


def _log_scalars(writer: Any, metrics: dict[str, Any], step: int) -> None:
    for k, v in metrics.items():
        if (
            k != "step"
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
        ):
            writer.add_scalar(k, v, step)


def load_run_config(run_path: Path) -> Config:
    return config_from_dict(RunDir(run_path).load_config_dict())


def run_path_for(cfg: Config) -> Path:
    return Path(os.path.expanduser(cfg.run.output_dir)) / cfg.run.name
