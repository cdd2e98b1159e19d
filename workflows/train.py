"""Durable RL training workflow over long-lived actors.

One step is a short sequence of named phases (plan, generate, score, shape, update, sync, observe,
persist); the method named by `algorithm.name` supplies the hooks of the phases it changes. A step is completed when its checkpoint is committed
in the run directory; `resume` continues after the last completed step with the same data order,
sampling seeds, weights, optimizer and controller state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from rlvr.config import (
    Config,
    ConfigError,
)
from rlvr.files import atomic_write_text
from rlvr.generation.base import SamplingParams
from rlvr.methods.base import build_method, method_class, timed
from rlvr.models import cache_dir, resolve_model_path
from rlvr.models.checks import check_lora_targets, check_model_dir, check_multi_turn_template
from rlvr.models.sft import sft_warmup
from rlvr.run.loggers import Loggers, check_loggers, open_loggers
from rlvr.run.metrics import (
    agent_stats,
    group_stats,
    reward_part_stats,
    rollout_stats,
    token_staleness,
    uncomputed_stats,
)
from rlvr.run.mfu import TransformerShape, peak_flops, step_utilisation
from rlvr.run.rundir import RunDir
from rlvr.tasks import load_task
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import render_prompt
from rlvr.tasks.sampler import PromptSampler
from rlvr.training.batch import TrainBatch, rows_that_train
from rlvr.training.losses import policy_loss
from workflows.components import Components, start_components
from workflows.rollout_pipeline import RolloutPipeline
from workflows.services import RunServices
from workflows.stopping import stop_if_asked
from workflows.workers import ActorFailure

log = logging.getLogger(__name__)

EVAL_SEED = 1234


def sampling_seed(run_seed: int, step: int) -> int:
    """Per-step sampling seed: a resumed step samples exactly what the uninterrupted one did."""
    return (run_seed * 1_000_003 + step * 7919) % (2**31 - 1)


def best_metric(cfg: Config) -> str:
    """The held-out metric that picks the best checkpoint: the method's (higher is better)."""
    return method_class(cfg.algorithm.name).best_metric


@dataclass
class Trainer:
    """Drives the step loop for one run directory; `cfg.algorithm.name` picks the method whose
    hooks the loop calls (`rlvr.methods.base.Method`)."""

    cfg: Config
    run: RunDir
    comps: Components
    tokenizer: Any
    train_problems: list[Problem]
    test_problems: list[Problem]
    model_dir: Path | None = None
    """The policy's starting weights (a method may start a worker on them, e.g. DRO's judge)."""
    use_actors: bool = True

    def __post_init__(self) -> None:
        self.sampler = PromptSampler(
            self.train_problems, self.cfg.generation.prompts_per_step, self.cfg.run.seed
        )
        self.method = build_method(self.cfg)
        self.loss = policy_loss(self.method.policy_loss, self.method.loss_module())
        self.services = RunServices(
            self.cfg,
            self.model_dir,
            self.comps,
            self.tokenizer,
            self.train_problems,
            self.test_problems,
            use_actors=self.use_actors,
            committed_metrics=self.run.read_metrics(),
            sampler=self.sampler,
        )
        self.method.start(self.services)
        run = self.cfg.run
        self.pipeline = (
            RolloutPipeline(
                self.method,
                self.services,
                run.max_staleness,
                run.steps,
                self._pipeline_batch,
                run.partial_rollout_tokens,
            )
            if run.max_staleness
            else None
        )
        self.version = 0
        """The policy version (updates applied) the policy holds."""
        self._last_step_end: float | None = None
        self.model_shape, self.peak_flops = model_utilisation_basis(self.cfg, self.model_dir)

    def _pipeline_batch(self, step: int) -> tuple[list[Problem], SamplingParams, int]:
        """What the pipeline collects for step `step`: the fixed group size (all that a method
        that `overlaps_generation` takes from the plan)."""
        return self.sampler.batch(step), self.sampling_params(step), self.cfg.generation.group_size

    def sampling_params(self, step: int) -> SamplingParams:
        """The training sampler of step `step`."""
        return self.cfg.generation.sampling_params(sampling_seed(self.cfg.run.seed, step))

    def evaluate(self, step: int) -> dict[str, Any]:
        """Held-out mean@k accuracy and mean response length of the policy alone, the method's
        validation figures beside them (`Method.evaluate`), and the name of the one that picks
        the best checkpoint."""
        g = self.cfg.generation
        params = g.sampling_params(EVAL_SEED, temperature=g.eval_temperature, top_p=1.0)
        n = {p.id: g.eval_samples for p in self.test_problems}
        t0 = time.perf_counter()
        pipeline = self.pipeline if self.pipeline and self.pipeline.feed else None
        with pipeline.engines_at(self.version, step) if pipeline else nullcontext():
            rollouts = self.services.generate(self.test_problems, n, params, step)
            method_stats = self.method.evaluate(self.services, self.test_problems, params, step)
        self.services.verify(rollouts)
        uncomputed = uncomputed_stats(
            rollouts.statuses, self.cfg.verifier.max_uncomputed_share, f"evaluation at step {step}"
        )
        record = {
            "step": step,
            "eval_accuracy": float(np.mean(rollouts.rewards >= 1.0)),
            "eval_reward": float(np.mean(rollouts.rewards)),
            "eval_length_mean": float(np.mean(rollouts.lengths)),
            "eval_problems": len(self.test_problems),
            "eval_samples": g.eval_samples,
            **{f"eval_{k}": v for k, v in uncomputed.items()},
            **{f"eval_{k}": v for k, v in reward_part_stats(rollouts.reward_parts).items()},
        }
        record.update(method_stats)
        record["eval_seconds"] = time.perf_counter() - t0
        record["best_metric"] = self.method.best_metric
        self.run.append_eval(record)
        return record

    def step(self, step: int) -> dict[str, Any]:
        """Run one training step and return its metrics (not yet persisted): plan, collect
        (generate + score), shape, update, sync, observe."""
        cfg, comps, method = self.cfg, self.comps, self.method
        times: dict[str, float] = {}
        t_start = time.perf_counter()
        problems = self.sampler.batch(step)

        with timed(times, "time_plan"):
            plan = comps.controller.plan_step(step, [p.id for p in problems])
        ahead = None
        if self.pipeline:
            if self.pipeline.feed is None:  # the engines hold self.version: start from there
                self.pipeline.start(self.comps.sync, self.sync_weights, self.version)
            self.pipeline.fill(step)
            ready = self.pipeline.ready()
            with timed(times, "time_wait_rollouts"):
                ahead = self.pipeline.take(step, plan["n"])
            got = ahead.collected
        else:
            t_collect = time.perf_counter()
            got = method.collect(
                self.services, problems, plan, self.sampling_params(step), step, times
            )
            engine_busy = time.perf_counter() - t_collect
        # before the update: a step whose rewards are damaged must not train
        uncomputed = uncomputed_stats(
            got.rollouts.statuses, cfg.verifier.max_uncomputed_share, f"step {step}"
        )
        batch, shape_stats = (
            method.shape(self.services, got.trained, plan, step) if len(got.trained) else (None, {})
        )
        with timed(times, "time_train"):
            train_stats = self.train(batch, len(got.trained), step)
        logprob_sums = train_stats.pop("logprob_sums", None)
        self.version = step + 1
        with timed(times, "time_sync"):
            if self.pipeline:
                # a snapshot for the batches that wait for it, or (pushed) once the engines
                # have collected every batch of older versions
                self.pipeline.publish(self.version, step)
            else:
                self.sync_weights(step)

        metrics: dict[str, Any] = {"step": step, "epoch": self.sampler.epoch_of(step)}
        rollouts = got.rollouts
        metrics.update(rollout_stats(rollouts.rewards, rollouts.lengths, rollouts.finish_reasons))
        metrics.update(reward_part_stats(rollouts.reward_parts))
        metrics.update(group_stats(rollouts.rewards, rollouts.group_ids))
        metrics.update(agent_stats(rollouts.flags))
        metrics.update(token_staleness(got.trained.flags, step))
        metrics.update(uncomputed)
        metrics.update(shape_stats)
        metrics.update(got.stats)
        metrics.update({f"train_{k}": v for k, v in train_stats.items()})
        metrics.update(method.observe(self.services, rollouts, step, logprob_sums, times))
        t_end = time.perf_counter()
        total = t_end - t_start
        metrics.update(times)
        metrics["time_step"] = total
        metrics["time_overhead"] = total - sum(times.values())
        # busy shares of the wall time since the step before ended (its commit and evaluation
        # included: the pipeline keeps collecting through them)
        since = self._last_step_end or t_start
        self._last_step_end = t_end
        if ahead is not None:
            # this step's rollouts were collected in the pipeline: their seconds are reported,
            # but they are not part of this step's time
            metrics.update(ahead.times)
            metrics["pipeline_ready_batches"] = ready
            metrics["busy_share_engines"] = self.pipeline.engines_busy_share(since, t_end)
        else:
            metrics["busy_share_engines"] = engine_busy / (t_end - since)
        metrics["busy_share_policy"] = times["time_train"] / (t_end - since)
        sampled_by = ahead.version if ahead is not None else step
        metrics["rollout_policy_version"] = sampled_by
        metrics["rollout_staleness"] = step - sampled_by
        metrics["tokens_per_s"] = metrics["tokens_generated"] / max(metrics["time_generate"], 1e-9)
        if self.model_shape is not None:
            metrics.update(
                step_utilisation(
                    self.model_shape,
                    [len(ids) for ids in got.trained.prompt_ids],
                    [len(ids) for ids in got.trained.response_ids],
                    {"time_train": metrics["time_train"]},
                    cfg.training.epochs,
                    self.peak_flops,
                )
            )
            metrics.update(
                step_utilisation(
                    self.model_shape,
                    [len(ids) for ids in rollouts.prompt_ids],
                    [len(ids) for ids in rollouts.response_ids],
                    {"time_generate": metrics["time_generate"]},
                    1,
                    self.peak_flops,
                )
            )

        comps.controller.observe_step(
            step,
            rollouts.rewards_by_group(),
            _json_safe(metrics),
            rollouts.records(step, limit=cfg.generation.prompts_per_step * 2),
        )
        self._last_rollouts = rollouts
        return metrics

    def train(self, batch: TrainBatch | None, rows: int, step: int) -> dict[str, Any]:
        """The policy update on the rows that carry loss (every row where the method's loss
        normaliser counts them); `logprob_sums` per batch row when the method observes them."""
        method = self.method
        if batch is None or not batch.num_loss_tokens:
            # DUET aborted every rollout, or DAPO found no informative group: no loss token
            log.warning("step %d: no rollout carries a loss token; the update is skipped", step)
            return {"skipped": 1, "logprob_sums": [0.0] * rows}
        kept = rows_that_train(batch, self.cfg.training.loss_agg, self.loss.counts_every_row)
        # the update takes the device (a colocated GPU) or the host memory (CPU engines)
        self.comps.generator.sleep(step)
        stats = self.comps.policy.train_step(
            batch if len(kept) == len(batch) else batch.select(kept),
            logprob_sums=method.needs_logprob_sums,
            step=step,
        )
        stats["rows"] = len(kept)
        if "logprob_sums" in stats:
            sums = [0.0] * len(batch)  # rows left out had no loss token: no surrogate use
            for row, value in zip(kept, stats["logprob_sums"], strict=True):
                sums[row] = value
            stats["logprob_sums"] = sums
        return stats

    def sync_weights(self, step: int | None = None) -> None:
        """Push the policy's current weights into every engine without restarting them (a
        sleeping colocated engine takes back its weights' memory first, its KV cache after)."""
        generator = self.comps.generator
        generator.wake("weights", step)
        self.comps.sync.push(step)
        generator.wake("kv_cache", step)

    def persist(self, step: int, metrics: dict[str, Any], best_step: int | None) -> None:
        """Commit step `step`: its log lines, then policy + optimizer and controller state.

        Logs go first: a crash before the checkpoint commits leaves lines that resume truncates,
        while the reverse order could lose a committed step's lines for good.
        """
        self.run.append_metrics(_json_safe(metrics))
        self.run.append_rollouts(self._last_rollouts.records(step))
        with self.run.writing_checkpoint(step) as d:
            self.comps.policy.save_state(str(d / "policy"), step=step)
            state = self.comps.controller.state_dict(step=step)
            atomic_write_text(d / "controller.json", json.dumps(state))
            progress = {
                "step": step,
                "best_step": best_step,
                "best_metric": self.method.best_metric,
            }
            atomic_write_text(d / "progress.json", json.dumps(progress))
            if self.pipeline:
                self.pipeline.save(d, self.version)
        self.run.prune(self.cfg.run.keep_last, keep={best_step} if best_step is not None else set())

    def restore(self, step: int) -> int | None:
        """Load the committed state of step `step`; returns the best step recorded there.

        The best step was picked by the metric recorded with it, which must be this run's.
        """
        d = self.run.step_dir(step)
        progress = json.loads((d / "progress.json").read_text())
        key = self.method.best_metric
        if progress.get("best_metric", key) != key:
            raise ConfigError(
                f"{self.run.path} picked its best checkpoint by {progress['best_metric']}, "
                f"this configuration by {key}"
            )
        self.comps.policy.load_state(str(d / "policy"))
        self.comps.controller.load_state_dict(json.loads((d / "controller.json").read_text()))
        if self.pipeline:
            self.pipeline.load(d, step)
        self.version = step + 1
        return progress["best_step"]


def model_utilisation_basis(
    cfg: Config, model_dir: Path | None
) -> tuple[TransformerShape | None, float | None]:
    """The policy's shape for its FLOP counts (None: no model directory, or a model type they
    do not cover) and the peak its MFU divides by: this machine's measured GEMM rate when the
    run is on CPUs (cached per machine), else None (GPU peaks are the devices' own, which the
    driver does not see; the FLOP/s are logged alone)."""
    config = model_dir / "config.json" if model_dir is not None else None
    if config is None or not config.is_file():
        return None, None
    try:
        shape = TransformerShape.from_hf_config(json.loads(config.read_text()))
    except (ValueError, KeyError) as err:
        log.info("no FLOP counts for %s: %s", model_dir, err)
        return None, None
    r = cfg.resources
    on_cpu = r.policy_gpus == 0 and r.generator_gpus == 0
    return shape, peak_flops(cfg.model.dtype, "cpu") if on_cpu else None


def _json_safe(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


def warmed_model(cfg: Config, model_dir: Path, train_problems: list[Problem]) -> Path:
    """`model_dir` after the SFT warm-up of `cfg.model` (sft_warmup_*), cached by content.

    With model.sft_warmup_problems set, the warm-up draws from that many training problems (the
    RL pool, task.n_train of them, is their prefix), and the cache entry does not depend on
    task.n_train, so a bench that resizes the pool reuses the warmed model."""
    m = cfg.model
    task_key = cfg.task.cache_key()
    problems = train_problems
    if m.sft_warmup_problems is not None:
        task_key = {k: v for k, v in task_key.items() if k != "n_train"}
        task_key["sft_problems"] = m.sft_warmup_problems
        problems, _ = load_task(cfg.task.model_copy(update={"n_train": m.sft_warmup_problems}))
    fields = type(m).model_fields
    tuned = [m.sft_warmup_lr, m.sft_warmup_batch_size]
    if tuned != [fields["sft_warmup_lr"].default, fields["sft_warmup_batch_size"].default]:
        task_key["sft"] = tuned  # defaults keep old keys
    # one cache entry per (model, steps, task): switching presets never rebuilds another's
    digest = hashlib.sha1(json.dumps(task_key, sort_keys=True).encode()).hexdigest()[:10]
    out = cache_dir() / "models" / f"{model_dir.name}-sft{m.sft_warmup_steps}-{digest}"
    return sft_warmup(
        model_dir,
        problems,
        out,
        steps=m.sft_warmup_steps,
        lr=m.sft_warmup_lr,
        batch_size=m.sft_warmup_batch_size,
        instruction=cfg.task.instruction,
        chat_template=cfg.task.chat_template,
        tool_traces=(
            cfg.env.settings(cfg.task.instruction, cfg.verifier.unsafe_hook_sandbox)
            if m.sft_warmup_traces == "tool_calls"
            else None
        ),
    )


def prepare(cfg: Config) -> tuple[Path, list[Problem], list[Problem]]:
    """Everything that can fail on bad input, done before any actor starts."""
    try:
        model_dir = resolve_model_path(cfg.model.path, seed=cfg.model.seed)
    except FileNotFoundError as err:
        raise ConfigError(f"invalid config: model.path: {err}") from None
    check_model_dir(model_dir, cfg.generation.max_model_len, cfg.vllm_on_cpu())
    if cfg.model.lora.enabled:
        check_lora_targets(model_dir, cfg.model.lora.target_modules)
    try:
        train_problems, test_problems = load_task(cfg.task)
    except ValueError as err:
        raise ConfigError(f"invalid config: task: {err}") from None
    if not train_problems:
        raise ConfigError("invalid config: task: the training set is empty")
    if not test_problems:
        raise ConfigError("invalid config: task: the held-out set is empty")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        task = cfg.task
        render_prompt(tokenizer, train_problems[0], task.instruction, task.chat_template)
    except ValueError as err:
        raise ConfigError(f"invalid config: {err}") from None
    if cfg.env.multi_turn:
        check_multi_turn_template(tokenizer, model_dir, cfg.env.kind, cfg.env.parser)
    if cfg.model.sft_warmup_steps:
        model_dir = warmed_model(cfg, model_dir, train_problems)
    return model_dir, train_problems, test_problems


def prepare_training(cfg: Config) -> tuple[Path, list[Problem], list[Problem]]:
    """`prepare`, after the check only training needs: the packages of `run.loggers` (evaluating
    or exporting a run's checkpoint needs none of them)."""
    check_loggers(cfg.run.loggers)
    return prepare(cfg)


def train(
    cfg: Config,
    run_path: Path,
    resume: bool = False,
    use_actors: bool = True,
    prepared: tuple[Path, list[Problem], list[Problem]] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train (or resume) the run at `run_path`, recovering from up to `run.max_failures` lost
    actors; returns the final summary (`progress`: show the progress bar on stderr).

    A lost actor (`ActorFailure.lost`) stops the attempt; the next one starts every actor anew
    and resumes after the last committed step, exactly as `rlvr train --resume` would, so the
    run ends bit-identical to an uninterrupted one. Each recovery is printed and appended to the
    run directory's recoveries.jsonl. An error raised inside a call (a bug, bad input) is not
    retried: it would only repeat. `prepared` is `prepare_training(cfg)`'s result when the caller
    validated the inputs before Ray started.
    """
    prepared = prepared or prepare_training(cfg)
    failures = 0
    while True:
        try:
            return _train_attempt(
                cfg, run_path, resume or failures > 0, use_actors, prepared, progress
            )
        except ActorFailure as err:
            if not err.lost:
                raise
            run = RunDir(run_path)
            last = run.last_completed_step()
            if failures >= cfg.run.max_failures:
                raise ActorFailure(
                    f"{err}; the run has recovered {failures} time(s), run.max_failures="
                    f"{cfg.run.max_failures}. Its last committed step is {last}: "
                    f"`rlvr train --resume {run_path}` continues from there",
                    lost=True,
                ) from err
            failures += 1
            run.append_recovery(
                {
                    "recovery": failures,
                    "cause": str(err),
                    "resumes_after": last,
                    "time": time.time(),
                }
            )
            print(
                f"rlvr: {err}; recovering ({failures} of run.max_failures="
                f"{cfg.run.max_failures}): restarting the actors, resuming after step {last}",
                file=sys.stderr,
                flush=True,
            )


def _train_attempt(
    cfg: Config,
    run_path: Path,
    resume: bool,
    use_actors: bool,
    prepared: tuple[Path, list[Problem], list[Problem]],
    progress: bool = True,
) -> dict[str, Any]:
    """One attempt at the run: resume after the last committed step (when `resume`), open the
    loggers of `run.loggers` (continuing their runs), train to the end."""
    run = RunDir(run_path)
    if not resume:
        if run.completed_steps():
            raise ConfigError(f"{run_path} already holds a run; use --resume or another run.name")
        run.create(cfg.to_dict())

    last = run.last_intact_step() if resume else None
    run.truncate_logs_after(last if last is not None else -1)
    first_logged = -1 if last is None else last + 1  # -1: the evaluation before training
    with open_loggers(cfg.run, run.path, cfg.to_dict(), first_logged) as loggers:
        return _train_after(cfg, run, last, use_actors, prepared, loggers, progress)


def _train_after(
    cfg: Config,
    run: RunDir,
    last: int | None,
    use_actors: bool,
    prepared: tuple[Path, list[Problem], list[Problem]],
    loggers: Loggers,
    progress: bool = True,
) -> dict[str, Any]:
    """Start the actors, restore step `last` (None: start afresh) and train after it to the end,
    each step's metrics to `loggers`; write the final model and summary."""
    from transformers import AutoTokenizer

    model_dir, train_problems, test_problems = prepared
    start = 0 if last is None else last + 1
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    comps = start_components(cfg, model_dir, use_actors=use_actors)
    if comps.layout:
        layout = {"actors": comps.layout, "weight_sync": comps.sync.transport}
        atomic_write_text(run.path / "layout.json", json.dumps(layout, indent=1))
    try:
        trainer = Trainer(
            cfg,
            run,
            comps,
            tokenizer,
            train_problems,
            test_problems,
            model_dir=model_dir,
            use_actors=use_actors,
        )
    except BaseException:
        comps.shutdown()
        raise
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
            loggers.log(before, -1)
        bar = tqdm(
            range(start, cfg.run.steps),
            initial=start,
            total=cfg.run.steps,
            desc=cfg.run.name,
            unit="step",
            disable=not progress,
        )
        for step in bar:
            # asked during the step before (now committed) or the first evaluation
            stop_if_asked(step)
            metrics = trainer.step(step)
            is_last = step == cfg.run.steps - 1
            if is_last or (cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0):
                ev = trainer.evaluate(step)
                metrics.update(ev)
                if best_value is None or ev[key] > best_value:
                    best_value, best_step = ev[key], step
            trainer.persist(step, metrics, best_step)
            loggers.log(metrics, step)
            bar.set_postfix(
                reward=f"{metrics['reward_mean']:.3f}",
                acc=f"{metrics['accuracy']:.3f}",
                tok_s=f"{metrics['tokens_per_s']:.0f}",
            )
        comps.policy.save_model(str(run.final_model))
        tokenizer.save_pretrained(run.final_model)
        evals = run.read_eval()
        summary = {
            "run_dir": str(run.path),
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
        comps.shutdown()
        if trainer.pipeline:
            trainer.pipeline.close()


def run_path_for(cfg: Config) -> Path:
    return Path(os.path.expanduser(cfg.run.output_dir)) / cfg.run.name
