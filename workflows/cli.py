"""The `rlvr` command: train, resume, demo and plot.

`rlvr train` starts a local Ray cluster bound to 127.0.0.1, or joins the cluster named by
RAY_ADDRESS (as `ray job submit` sets it). Configuration errors exit with status 2 before any
actor starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from rlvr.config import Config, ConfigError, load_config

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-arith.yaml"


def _ray_env() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def init_ray(cfg: Config) -> None:
    """Join RAY_ADDRESS when set; otherwise start an in-process cluster on 127.0.0.1."""
    import ray

    from actors.controller import NAMESPACE

    if os.environ.get("RAY_ADDRESS"):
        ray.init(namespace=NAMESPACE, log_to_driver=True)
        cfg.check_cpus(ray.cluster_resources().get("CPU", 0.0))
    else:
        cpus = os.cpu_count() or 1
        cfg.check_cpus(cpus)
        ray.init(
            num_cpus=cpus,
            namespace=NAMESPACE,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
        )


def cmd_train(args: argparse.Namespace) -> int:
    from workflows.train import load_run_config, prepare, run_path_for, train

    if args.resume:
        run_path = Path(args.resume)
        cfg = load_run_config(run_path)
        if args.set:
            raise ConfigError("--set cannot change a run being resumed; start a new run instead")
    else:
        cfg = load_config(args.config, args.set)
        run_path = run_path_for(cfg)
    prepared = prepare(cfg)  # bad models or data fail here, before Ray or any actor starts
    init_ray(cfg)
    summary = train(
        cfg, run_path, resume=bool(args.resume), use_actors=not args.in_process, prepared=prepared
    )
    print(json.dumps(summary, indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from workflows.train import prepare, run_path_for, train

    cfg = load_config(args.config or DEMO_CONFIG, args.set)
    run_path = run_path_for(cfg)
    if run_path.exists():
        import shutil

        shutil.rmtree(run_path)
    prepared = prepare(cfg)
    init_ray(cfg)
    summary = train(cfg, run_path, prepared=prepared)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvr", description=__doc__.splitlines()[0])
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
    t.set_defaults(fn=cmd_train)

    d = sub.add_parser(
        "demo", help="train SmolLM2-135M-Instruct on arithmetic and show before/after"
    )
    d.add_argument("--config", help="preset to use instead of configs/smollm2-arith.yaml")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    d.set_defaults(fn=cmd_demo)

    pl = sub.add_parser("plot", help="write PNG curves of a run")
    pl.add_argument("run_dir")
    pl.set_defaults(fn=cmd_plot)
    return p


def main(argv: list[str] | None = None) -> int:
    _ray_env()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"rlvr: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
