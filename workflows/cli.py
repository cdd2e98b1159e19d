"""The `rlvr` command: train, resume, demo, plot, serve, calibrate, evaluate, tandem-eval, export,
and DRO's filter and rubrics.

Training, evaluation and serving go through the Python API (`workflows.api`, exposed as
`rlvr.train`, `rlvr.evaluate`, `rlvr.serve`), of which these commands are a thin layer.

`rlvr train` starts a local Ray cluster bound to 127.0.0.1, which ends with it however it ends
(`workflows.reaper`), or joins the cluster named by RAY_ADDRESS (as `ray job submit` sets it).
Configuration errors exit with status 2 before any actor starts. The actors' own output (vLLM,
DeepSpeed, Ray's worker lines) goes to the run's `engine.log` unless `--engine-logs` asks for it
on the console. Ctrl-C stops a run after its current step, a second Ctrl-C or SIGTERM at once
(`workflows.stopping`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from rlvr.config import Config, ConfigError, load_config
from workflows.cluster import ENGINE_LOGS_HELP, quiet_driver, ray_env
from workflows.stopping import RunStopped

DEMO_CONFIG = "smollm2-arith"
"""The shipped preset `rlvr demo` trains (`rlvr.config.presets`)."""


def cmd_train(args: argparse.Namespace) -> int:
    """`rlvr train`: `workflows.api.train` in the foreground; its summary as JSON."""
    if not (args.engine_logs or args.in_process):  # in-process, the engines run right here
        quiet_driver()
    from workflows.api import train

    if args.resume and args.set:
        raise ConfigError("--set cannot change a run being resumed; start a new run instead")
    try:
        summary = train(
            None if args.resume else args.config,
            args.set,
            resume=Path(args.resume) if args.resume else False,
            engine_logs=args.engine_logs,
            in_process=args.in_process,
        )
    except RunStopped as stop:
        return report_stop(stop, stop.run_path)
    print(json.dumps(summary, indent=2))
    return 0


def report_stop(stop: RunStopped, run_path: Path) -> int:
    """Say where a run stopped by a signal can continue; its exit status (128 + the signal)."""
    from rlvr.run.rundir import RunDir

    how = "after the current step" if stop.at_boundary else "at once"
    last = RunDir(run_path).last_completed_step()
    where = (
        f"its last committed step is {last}: `rlvr train --resume {run_path}` continues from there"
        if last is not None
        else "no step was committed"
    )
    print(f"rlvr: stopped by {stop.signal_name} {how}; {where}", file=sys.stderr)
    return stop.exit_code


def fresh_run_name(output_dir: Path, name: str) -> str:
    """`name`, or the first of `name-2`, `name-3`, ... with no directory under `output_dir`."""
    candidate, n = name, 1
    while (output_dir / candidate).exists():
        n += 1
        candidate = f"{name}-{n}"
    return candidate


def demo_run_path(cfg: Config, overwrite: bool) -> Path:
    """Where the demo writes: the configured run, deleted first when `overwrite` (and said so);
    otherwise a fresh run name (set in `cfg`), so an earlier run is never lost."""
    from workflows.train import run_path_for

    run_path = run_path_for(cfg)
    if not run_path.exists():
        return run_path
    if overwrite:
        import shutil

        print(f"rlvr: --overwrite: deleting the earlier run {run_path}", file=sys.stderr)
        shutil.rmtree(run_path)
        return run_path
    cfg.run.name = fresh_run_name(run_path.parent, cfg.run.name)
    print(f"rlvr: {run_path} exists; this demo runs as {cfg.run.name}", file=sys.stderr)
    return run_path_for(cfg)


def cmd_demo(args: argparse.Namespace) -> int:
    if not args.engine_logs:
        quiet_driver()
    from workflows.api import train

    cfg = load_config(args.config or DEMO_CONFIG, args.set)
    run_path = demo_run_path(cfg, args.overwrite)
    try:
        summary = train(cfg, engine_logs=args.engine_logs)
    except RunStopped as stop:
        return report_stop(stop, run_path)
    print(format_before_after(summary))
    from workflows.plot import plot_run

    for png in plot_run(run_path):
        print(f"plot: {png}")
    return 0


def format_before_after(summary: dict) -> str:
    before, after = summary["eval_before"], summary["eval_after"]
    rows = [
        ("held-out accuracy", f"{before['eval_accuracy']:.3f}", f"{after['eval_accuracy']:.3f}"),
        (
            "mean response length",
            f"{before['eval_length_mean']:.1f}",
            f"{after['eval_length_mean']:.1f}",
        ),
    ]
    lines = [
        f"{'':24s}{'before':>10s}{'after':>10s}",
        *[f"{a:24s}{b:>10s}{c:>10s}" for a, b, c in rows],
        f"problems: {before['eval_problems']}  steps: {summary['steps']}  model: {summary['final_model']}",
    ]
    return "\n".join(lines)


def cmd_plot(args: argparse.Namespace) -> int:
    from workflows.plot import plot_run

    for png in plot_run(Path(args.run_dir)):
        print(png)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """`rlvr serve`: `workflows.api.serve` in the foreground, until Ctrl-C."""
    from workflows.api import serve

    serve(args.config, args.set)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from workflows.calibrate import EngineOptions, run_calibrate

    for name in ("k", "max_tokens", "m"):
        if getattr(args, name) < 1:
            raise ConfigError(f"invalid calibration input: --{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ConfigError("invalid calibration input: need --temperature >= 0, 0 < --top-p <= 1")
    engine = EngineOptions(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        enforce_eager=args.enforce_eager,
        threads=args.threads,
    )
    path, cal = run_calibrate(
        args.checkpoint,
        args.data,
        adapter=args.adapter,
        out=args.out,
        backend=args.backend,
        cal_fraction=args.cal_fraction,
        seed=args.seed,
        alphas=args.alpha,
        engine=engine,
        k=args.k,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        m=args.m,
        spacing=args.spacing,
    )
    summary = cal.to_dict(args.alpha)
    print(
        json.dumps(
            {"path": str(path)}
            | {k: summary[k] for k in ("version", "n_cal", "accuracy", "calibrator", "grids")},
            indent=2,
        )
    )
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """`rlvr evaluate`: accuracy, pass@k and lengths of a checkpoint on a dataset, in this
    process (`workflows.api.evaluate`)."""
    from workflows.api import evaluate

    summary = evaluate(
        args.checkpoint,
        data=args.data,
        config=args.config,
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        backend=args.backend,
        use_env=not args.no_env,
        out=args.out,
    )
    keys = (
        "out",
        "problems",
        "problems_scored",
        "uncomputed",
        "uncomputed_by_status",
        "accuracy",
        "pass_at_k",
        "mean_length",
        "truncated_frac",
        "env",
        "agent",
    )
    print(json.dumps({k: summary[k] for k in keys if k in summary}, indent=2))
    return 0


def cmd_tandem_eval(args: argparse.Namespace) -> int:
    """`rlvr tandem-eval`: Tandem's held-out metrics of a checkpoint against a junior, in this
    process."""
    from workflows.tandem_eval import run_tandem_eval

    if args.n < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ConfigError(
            "invalid evaluation input: need --n >= 1, --temperature >= 0, 0 < --top-p <= 1"
        )
    optional = {"max_tokens": args.max_tokens, "seed": args.seed}
    out, report = run_tandem_eval(
        args.checkpoint,
        junior=args.junior,
        config=args.config,
        out=args.out,
        backend=args.backend,
        n=args.n,
        ks=tuple(args.k),
        temperature=args.temperature,
        top_p=args.top_p,
        step_boundary=args.step_boundary.encode().decode("unicode_escape"),
        **{k: v for k, v in optional.items() if v is not None},
    )
    summary = {
        "out": str(out),
        "solo pass@k": {k: v["mean"] for k, v in report["solo_senior"]["pass_at_k"].items()},
        "handoff strict pass@k": {
            k: v["mean"] for k, v in report["handoff"]["strict"]["pass_at_k"].items()
        },
        "junior CE": report["legibility"]["junior_ce"]["mean"],
        "overlap": report["legibility"]["overlap"]["mean"],
        "KL(senior || junior)": report["drift"]["kl_to_junior"],
    }
    print(json.dumps(summary, indent=2))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """`rlvr export`: a step checkpoint (or a run's newest) as a loadable HF directory."""
    from workflows.checkpoints import export_checkpoint

    print(f"exported: {export_checkpoint(args.checkpoint, args.out)}")
    return 0


def cmd_dro_offline(args: argparse.Namespace) -> int:
    """`rlvr filter` / `rlvr rubrics`: DRO's offline passes, in this process."""
    from workflows.dro_offline import run_filter, run_rubrics

    # DRO's passes read algorithm.dro, whatever method the preset trains with
    cfg = load_config(args.config, ["algorithm.name=dro", *args.set])
    run = run_filter if args.command == "filter" else run_rubrics
    print(json.dumps(run(cfg, Path(args.out) if args.out else None), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvr", description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a policy (or resume a run)")
    t.add_argument("--config", help="YAML preset (see configs/)")
    t.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    t.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR after its last completed step",
    )
    t.add_argument(
        "--in-process", action="store_true", help="run the workers in this process (debugging)"
    )
    t.add_argument("--engine-logs", action="store_true", help=ENGINE_LOGS_HELP)
    t.set_defaults(fn=cmd_train)

    d = sub.add_parser(
        "demo", help="train SmolLM2-135M-Instruct on arithmetic and show before/after"
    )
    d.add_argument("--config", help="preset to use instead of configs/smollm2-arith.yaml")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an earlier run of the same name (default: run as NAME-2, NAME-3, ...)",
    )
    d.add_argument("--engine-logs", action="store_true", help=ENGINE_LOGS_HELP)
    d.set_defaults(fn=cmd_demo)

    pl = sub.add_parser("plot", help="write PNG curves of a run")
    pl.add_argument("run_dir")
    pl.set_defaults(fn=cmd_plot)

    sv = sub.add_parser("serve", help="serve a checkpoint over HTTP behind the CSA release gate")
    sv.add_argument("--config", help="serve YAML (see configs/serve-tiny.yaml)")
    sv.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sv.set_defaults(fn=cmd_serve)

    c = sub.add_parser("calibrate", help="fit the CSA score map and grid of a checkpoint")
    c.add_argument(
        "--checkpoint", required=True, help="'tiny', 'tiny-llama', 'smollm2' or an HF directory"
    )
    c.add_argument(
        "--data", required=True, help="JSONL/parquet problems, or a training preset YAML"
    )
    c.add_argument("--adapter", help="PEFT adapter merged into the checkpoint")
    c.add_argument("--out", help="artefact path (default: csa_calibration.json beside it)")
    c.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    c.add_argument("--k", type=int, default=5, help="self-consistency samples per problem")
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights dtype of the engine (as model.dtype in training and serving)",
    )
    c.add_argument(
        "--max-model-len", type=int, default=1024, help="prompt + response context of the engine"
    )
    c.add_argument(
        "--kv-cache-gib",
        type=float,
        default=1.0,
        help="vLLM's KV cache size, fixed: vLLM then starts however little memory is free (left "
        "to size itself on CPU, it claims 90%% of the memory and refuses to start without it)",
    )
    c.add_argument(
        "--enforce-eager",
        action="store_true",
        help="skip vLLM's torch.compile: starts faster, decodes slower",
    )
    c.add_argument("--threads", type=int, help="CPU threads of the engine (default: every core)")
    c.add_argument("--cal-fraction", type=float, default=0.2, help="CAL share of the data")
    c.add_argument("--seed", type=int, default=42, help="CAL split and sampling seed")
    c.add_argument("--m", type=int, default=15, help="grid size")
    c.add_argument("--spacing", choices=["geometric", "linear"], default="geometric")
    c.add_argument(
        "--alpha",
        type=float,
        nargs="+",
        default=[0.05, 0.1, 0.15, 0.2, 0.25, 0.3],
        help="budgets whose grids are written",
    )
    c.set_defaults(fn=cmd_calibrate)

    ge = sub.add_parser(
        "evaluate", help="accuracy, pass@k and lengths of a checkpoint on a dataset (JSON + PNG)"
    )
    ge.add_argument(
        "--checkpoint",
        required=True,
        help="run directory, its final/ or a step checkpoint, an HF directory or a PEFT adapter",
    )
    ge.add_argument(
        "--data",
        help="a preset (its held-out split) or a dataset file (default: the run's held-out split)",
    )
    ge.add_argument("--config", help="run config (default: the run directory's config.yaml)")
    ge.add_argument("--n", type=int, default=4, help="samples per problem")
    ge.add_argument("--temperature", type=float, default=1.0)
    ge.add_argument("--top-p", type=float, default=1.0)
    ge.add_argument("--max-tokens", type=int, help="default: the config's generation.max_tokens")
    ge.add_argument("--seed", type=int, default=0, help="base sampling seed")
    ge.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    ge.add_argument(
        "--no-env",
        action="store_true",
        help="single-turn, without the run's tools or environment (its env section)",
    )
    ge.add_argument("--out", help="output folder (default: <run>/eval-<checkpoint>)")
    ge.set_defaults(fn=cmd_evaluate)

    ev = sub.add_parser(
        "tandem-eval", help="Tandem metrics of a checkpoint against a junior (JSON + plots)"
    )
    ev.add_argument(
        "--checkpoint",
        required=True,
        help="run directory, its final/ or a step checkpoint, an HF directory or a PEFT adapter",
    )
    ev.add_argument("--junior", help="junior model directory (default: the run's starting model)")
    ev.add_argument("--config", help="run config (default: the run directory's config.yaml)")
    ev.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8], help="pass@k values of k")
    ev.add_argument("--n", type=int, default=8, help="samples and handoff chains per problem")
    ev.add_argument("--out", help="output folder (default: <run>/tandem_eval-<checkpoint>)")
    ev.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    ev.add_argument("--temperature", type=float, default=0.7)
    ev.add_argument("--top-p", type=float, default=0.8)
    ev.add_argument("--max-tokens", type=int, help="default: the config's generation.max_tokens")
    ev.add_argument(
        "--step-boundary",
        default="\\n\\n",
        help="handoff turns end at this string (escapes allowed; the tiny task's steps end in \\n)",
    )
    ev.add_argument("--seed", type=int, help="base sampling seed (default 0)")
    ev.set_defaults(fn=cmd_tandem_eval)

    ex = sub.add_parser("export", help="write a step checkpoint as a Hugging Face model directory")
    ex.add_argument(
        "checkpoint", help="a step checkpoint (runs/NAME/checkpoints/step_N) or a run directory"
    )
    ex.add_argument(
        "out", help="new directory: merged weights and tokenizer (+ adapter/ with LoRA)"
    )
    ex.set_defaults(fn=cmd_export)

    for name, text, out in (
        (
            "filter",
            "DRO query filter: score queries, write the retained dataset",
            "directory (default: <run.output_dir>/<run.name>-filter)",
        ),
        (
            "rubrics",
            "DRO rubrics: write and validate each training query's rubrics",
            "JSON file (default: the rubric cache training reads)",
        ),
    ):
        dp = sub.add_parser(name, help=text)
        dp.add_argument("--config", required=True, help="training preset with algorithm.dro")
        dp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        dp.add_argument("--out", help=f"output {out}")
        dp.set_defaults(fn=cmd_dro_offline)
    return p


def main(argv: list[str] | None = None) -> int:
    ray_env()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    from workflows.workers import ActorFailure

    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"rlvr: {err}", file=sys.stderr)
        return 2
    except ActorFailure as err:  # the actors' own tracebacks are in the run's engine log
        print(f"rlvr: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
