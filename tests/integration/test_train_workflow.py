"""The training spine end to end on the tiny model: actors, run directory, resume, bad input."""

from __future__ import annotations

import json
import math

import psutil
import pytest

from workflows.cli import main as cli_main

WEIGHTED_REWARDS = (
    "verifier.rewards=[{kind: math, weight: 1.0}, "
    "{kind: python, function: 'rlvr.verifiers.rewards:boxed_format', weight: 0.5}]"
)


def test_run_directory_contents(tiny_run_dir, logger_stores):
    run = tiny_run_dir
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    for m in metrics:
        assert m["rollouts"] == 16  # 4 prompts x 4 samples
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert m["time_step"] >= m["time_generate"] > 0
        assert "train_loss" in m and "train_grad_norm" in m
        assert m["train_optimizer_steps"] == 2 and len(m["train_updates"]) == 2
        # vLLM and the trainer compute the same tempered fp32 log-probs to ~1e-5
        assert m["train_engine_ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    # cosine to 0 over 4 steps x 2 optimizer steps after 1 warm-up step, from training.lr
    lrs = [u["lr"] for m in metrics for u in m["train_updates"]]
    want = [0.5 * (1 + math.cos(math.pi * max(k - 1, 0) / 7)) for k in range(8)]
    assert lrs == pytest.approx([lrs[0] * w for w in want], rel=1e-9)
    # LACONIC (budget 12, eta 0.05): lambda steps by the signed violation, read once per step
    assert metrics[0]["laconic_lambda"] == 0.0
    for prev, m in zip(metrics, metrics[1:], strict=False):
        assert m["laconic_lambda"] == prev["laconic_lambda_next"]
    for m in metrics:
        expected = m["laconic_lambda"] + 0.05 * (m["laconic_length_mean"] / 12 - 1)
        assert m["laconic_lambda_next"] == pytest.approx(min(max(expected, 0.0), 0.3), abs=1e-12)
        assert m["laconic_length_mean"] == pytest.approx(m["length_mean"])
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [-1, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert (run / "final" / "model.safetensors").is_file()
    # each store of run.loggers holds the numbers of metrics.jsonl and eval.jsonl, by step
    want = {
        "reward_mean": {m["step"]: m["reward_mean"] for m in metrics},
        "eval_accuracy": {e["step"]: e["eval_accuracy"] for e in evals},
    }
    [(wandb_id, wandb_series)] = logger_stores.wandb(run)
    [(mlflow_run, mlflow_series)] = logger_stores.mlflow(run, "full")
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["run.loggers"] == '["tensorboard", "mlflow", "wandb"]'
    ids = json.loads((run / "loggers.json").read_text())
    assert ids == {"mlflow": mlflow_run.info.run_id, "wandb": wandb_id}
    for series in (logger_stores.tensorboard(run), wandb_series, mlflow_series):
        for name, by_step in want.items():
            assert series[name] == pytest.approx(by_step, rel=1e-6), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_before"]["step"] == -1


PARTIAL_TOKENS = 16


def test_a_run_with_stale_rollouts_resumes_exactly(
    tmp_path, run_cli, tiny_train_args, run_records, assert_same_weights, run_control
):
    """run.max_staleness=2 with partial rollouts: step t trains on rollouts whose first 16
    tokens were sampled by policy version max(0, t - 2) and the rest by max(0, t - 1), collected
    in the background pipeline, the engines loading snapshots of the policy (the newer one in
    the middle of the batch). Its driver SIGKILLed once step 0 commits (its checkpoint holds steps
    1 and 2's rollouts; step 3's are sampled after the resume from the checkpoint's own weights),
    taking every process of its cluster with it, then,
    resumed, its GeneratorActor killed once the resumed run commits its first step (recovered
    within the run: the pipeline restarts from that checkpoint), the run ends bit-identical to
    the uninterrupted one. The reward is math's plus half a format plug-in's
    (verifier.rewards), each logged apart."""
    extra = (
        "run.steps=4",
        "run.max_staleness=2",
        f"run.partial_rollout_tokens={PARTIAL_TOKENS}",
        WEIGHTED_REWARDS,
    )
    # the uninterrupted run beside the one that is interrupted
    full = run_cli(tiny_train_args(tmp_path / "a", *extra))
    reference = run_control.in_background(full)
    proc = run_cli(tiny_train_args(tmp_path / "b", *extra))
    ckpt = tmp_path / "b" / "full" / "checkpoints" / "step_000000"
    run_control.wait_for_actors(proc)
    cluster, reaper = run_control.cluster_of(psutil.Process(proc.pid))
    assert run_control.programs(cluster) >= run_control.CLUSTER
    last = run_control.kill_driver_after_commit(proc, ckpt)
    assert last < 2, "the killed run got too far for the resume to lose an engine mid-run"
    # SIGKILL leaves the driver no way to clean up: Ray's GCS and raylet end with it, its workers
    # with the raylet, and the reaper stops the rest (Ray's agents would linger a minute
    # reporting the loss to the dead GCS).
    reaper.wait(timeout=120)
    assert run_control.alive(cluster) == []
    assert (ckpt / "pipeline.pkl").is_file()
    resumed = run_cli(["train", "--resume", str(tmp_path / "b" / "full")])
    # a step the resumed run commits itself: its actors are up (the final evaluation at the
    # latest meets the lost engine)
    run_control.wait_for_commit(resumed, ckpt.with_name(f"step_{last + 1:06d}"), poll_s=0.01)
    run_control.kill_actor(resumed, "GeneratorActor")
    log, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, log[-4000:]
    assert log.count("recovering (") == 1, log[-4000:]
    log = reference.result(timeout=900)
    assert full.returncode == 0, log[-4000:]

    run_a = tmp_path / "a" / "full"
    a = [json.loads(x) for x in (run_a / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_policy_version"] for m in a] == [0, 0, 0, 1]
    assert [m["rollout_staleness"] for m in a] == [0, 1, 2, 2]  # the oldest tokens'
    # steps 0 and 1 are sampled by version 0 alone; steps 2 and 3 move one version forward
    # after 16 tokens, and most of the tiny model's samples are longer
    assert [m["token_staleness_max"] for m in a] == [0, 1, 2, 2]
    assert "token_staleness_share_1" not in a[0] and a[1]["token_staleness_share_1"] == 1
    for m in a[2:]:
        assert m["token_staleness_share_1"] + m["token_staleness_share_2"] == pytest.approx(1)
        assert 1 < m["token_staleness_mean"] < 2
    assert json.loads((run_a / "layout.json").read_text())["weight_sync"] == "object_store"
    for m in a:
        parts = m["reward/math_mean"] + 0.5 * m["reward/boxed_format_mean"]
        assert m["reward_mean"] == pytest.approx(parts, abs=1e-12)
        # collected in the pipeline: not part of this step's time
        assert m["time_generate"] > 0 and m["time_wait_rollouts"] >= 0
        assert 0 <= m["busy_share_engines"] <= 1 and 0 < m["busy_share_policy"] <= 1
    runs = [tmp_path / d / "full" for d in ("a", "b")]
    for name in ("metrics.jsonl", "rollouts.jsonl", "eval.jsonl"):
        assert run_records(runs[0], name) == run_records(runs[1], name), name
    last = run_a / "checkpoints" / "step_000003"
    assert not (last / "pipeline.pkl").exists()  # the last step collects nothing ahead
    assert_same_weights(*runs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.path=/nonexistent/model"], "model.path"),
        (["generation.group_size=1"], "generation.group_size"),
        (["resources.num_verifiers=64", "resources.verifier_cpus=1"], "resources: the actors need"),
        (["task.name=file", "task.train_path=/nonexistent.jsonl"], "task:"),
        (["run.loggers=[tensorboard,neptune]"], "run.loggers.1: Input should be"),
    ],
)
def test_bad_input_fails_before_any_actor(tmp_path, capsys, tiny_config, overrides, message):
    args = ["train", "--config", str(tiny_config), f"--set=run.output_dir={tmp_path}"]
    args += [f"--set={o}" for o in overrides]
    assert cli_main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "tiny").exists()


def test_empty_dataset_is_named(tmp_path, capsys, tiny_config):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = [
        "train",
        "--config",
        str(tiny_config),
        f"--set=run.output_dir={tmp_path}",
        "--set=task.name=file",
        f"--set=task.train_path={empty}",
    ]
    assert cli_main(args) == 2
    assert "empty" in capsys.readouterr().err


def test_export_writes_a_step_as_the_model_it_was(tiny_run_dir, tmp_path, run_cli):
    """`rlvr export RUN OUT` converts the newest step checkpoint (the last step here) into an HF
    directory whose weights are the run's final model, bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exported"
    proc = run_cli(["export", str(tiny_run_dir), str(out)])
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    assert f"exported: {out}" in log
    want = load_file(tiny_run_dir / "final" / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert want.keys() == got.keys()
    for k in want:
        assert (want[k] == got[k]).all(), k  # exact: the same state through the same save path
    AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    again = run_cli(["export", str(tiny_run_dir / "checkpoints" / "step_000003"), str(out)])
    log, _ = again.communicate(timeout=600)
    assert again.returncode == 2 and "exists" in log
    elsewhere = run_cli(["export", str(tmp_path), str(tmp_path / "x")])
    log, _ = elsewhere.communicate(timeout=600)
    assert elsewhere.returncode == 2 and "not in a run directory" in log


def test_evaluate_any_checkpoint_on_any_data(tiny_run_dir, tmp_path, capsys):
    """`rlvr evaluate` of a finished run on its held-out split, and of the same model on a
    published-format (GSM8K-style) file: the summary agrees with the per-item records."""
    out = tmp_path / "eval"
    argv = ["evaluate", "--checkpoint", str(tiny_run_dir), "--backend", "hf", "--n", "2"]
    assert cli_main([*argv, "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    summary = json.loads((out / "evaluation.json").read_text())
    items = [json.loads(x) for x in (out / "items.jsonl").read_text().splitlines()]
    assert printed["out"] == str(out) and (out / "evaluation.png").stat().st_size > 0
    assert summary["problems"] == len(items) == 16  # the fixture's task.n_test
    assert all(len(i["samples"]) == len(i["correct"]) == 2 for i in items)
    correct = [c for i in items for c in i["correct"]]
    assert summary["accuracy"] == pytest.approx(sum(correct) / len(correct), abs=1e-12)
    assert summary["pass_at_k"]["1"] == pytest.approx(summary["accuracy"], abs=1e-12)
    either = sum(any(i["correct"]) for i in items) / len(items)
    assert summary["pass_at_k"]["2"] == pytest.approx(either, abs=1e-12)  # n = k: any correct
    assert summary["sampling"]["max_tokens"] == 24  # the run's generation.max_tokens
    gsm8k = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"{a} + {a}?", "answer": f"{a} and {a} #### {2 * a}"} for a in (1, 2, 3)]
    gsm8k.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli_main([*argv, "--data", str(gsm8k), "--out", str(tmp_path / "g")]) == 0
    items = [json.loads(x) for x in (tmp_path / "g" / "items.jsonl").read_text().splitlines()]
    assert [i["gold"] for i in items] == ["2", "4", "6"]
    assert cli_main(["evaluate", "--checkpoint", str(tmp_path / "nothing")]) == 2


# A second architecture through the same spine: Llama (bias-free attention, untied LM head, Llama
# 3 rope scaling) with LoRA adapters, the shared-prefix packed forward, the trainer's token-budget
# micro-batches and the chunked LM head, after a short SFT warm-up, its policy rank and engine
# colocated in one bundle (weights handed over between them). The warm-up is too short for correct answers: LACONIC's dual starts
# above 0, so the length cost alone gives step 0 advantages and an update. lr 5e-3 moves the
# adapters far: the two updates shift the log-probs of the final model's own samples by about 0.3
# nats a token on average, so an engine left with stale weights would miss the 1e-3 below by far.
LLAMA = [
    "model.path=tiny-llama",
    "model.sft_warmup_steps=5",
    "algorithm.laconic.lam_init=0.2",
    "model.lora.enabled=true",
    "training.lr=5e-3",
    "training.shared_prefix=true",
    "training.lm_head_chunk=16",
    "training.micro_batch_tokens=128",
    "resources.colocate=true",
    "resources.policy_cpus=0.5",
    "resources.generator_cpus=0.5",
    "sync.bucket_mb=0.25",
    "run.steps=2",
]


def test_tiny_llama_trains_with_lora_colocated_and_hands_weights_to_the_engine(
    tmp_path, capsys, run_cli, tiny_train_args
):
    """A 2-step LoRA run on the tiny Llama through the actors (vLLM, DeepSpeed, verifier pool),
    each policy rank colocated with its engine: the adapters learn, vLLM samples step 1 with the
    weights handed over (its log-probs those of the trainer's pi_old within 1e-3), and the final
    model loads and evaluates."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    proc = run_cli(tiny_train_args(tmp_path, *LLAMA))
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    run = tmp_path / "full"
    written = json.loads((run / "layout.json").read_text())
    assert written["weight_sync"] == "colocated"  # "auto" when colocated
    layout = written["actors"]
    assert layout["PolicyActor 0"] == layout["GeneratorActor 0"]
    assert (layout["PolicyActor 0"]["group"], layout["PolicyActor 0"]["bundle"]) == ("colocated", 0)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["time_sync"] > 0
        assert m["rollouts"] == 16 and m["train_optimizer_steps"] == 2
        assert m["train_engine_ratio_mean"] == pytest.approx(1.0, abs=1e-3)
        assert m["train_engine_ratio_max"] < 1.0 + 1e-3
        assert abs(m["train_engine_kl"]) < 1e-4
    adapters = load_file(run / "final" / "adapter" / "adapter_model.safetensors")
    lora_b = [t for name, t in adapters.items() if "lora_B" in name]
    assert lora_b and all(t.abs().max() > 0 for t in lora_b)  # B starts at 0: every one learned
    final = AutoModelForCausalLM.from_pretrained(run / "final")
    assert final.config.model_type == "llama" and not final.config.tie_word_embeddings
    argv = ["evaluate", "--checkpoint", str(run), "--backend", "hf", "--n", "1"]
    assert cli_main([*argv, "--out", str(tmp_path / "eval")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["problems"] == 16 and 0.0 <= summary["accuracy"] <= 1.0
