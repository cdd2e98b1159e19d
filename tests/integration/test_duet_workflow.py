"""DUET end to end on the tiny model through the actors: per-prompt counts from the ControllerActor,
the stop rule inside the vLLM engine, zero weight for aborted rollouts, and a killed run resumed
from its checkpoint planning exactly what its checkpointed DUET state dictates."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter

from rlvr.methods.base import build_method
from rlvr.run.controller import TrainingController
from workflows.checkpoints import load_run_config

# 4 training prompts, 4 per step: every step revisits every prompt, so step 1 already allocates
# from observed surrogates. Cold K1 = 9, K2 = 22 (of 32 tokens), grace 2: rollouts without a
# closed \boxed{} by token 24 draw the coin (eps 0.5, so both branches show up in 16 rollouts).
# Temperature 1.5 spreads the SFT-warmed model's samples so groups have a surrogate to observe.
DUET = [
    "algorithm.name=duet",
    "algorithm.duet.b=1",
    "algorithm.duet.n_ref=4",
    "algorithm.duet.grace=2",
    "algorithm.duet.poll_every=1",
    "algorithm.duet.k1_min=4",
    "algorithm.duet.k2_gap=4",
    "algorithm.duet.eps_abort=0.5",
    "algorithm.duet.floor_min=0.01",
    "generation.max_tokens=32",
    "generation.temperature=1.5",
    "task.n_train=4",
    "run.steps=2",
]


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def test_duet_steps_through_the_actors_and_resumes(tmp_path, run_cli, tiny_train_args):
    run = tmp_path / "full"
    proc = run_cli(tiny_train_args(tmp_path, *DUET))
    # step 0 is cold (uniform 4 per prompt): kill once its 16 rollouts are logged
    deadline = time.monotonic() + 600
    while sum(r["step"] == 0 for r in _lines(run / "rollouts.jsonl")) < 16:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = run_cli(["train", "--resume", str(run)])
    log, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, log[-4000:]

    metrics = _lines(run / "metrics.jsonl")
    rollouts = _lines(run / "rollouts.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        # planned cost sum n_q L_hat_q within the budget B = b * n_ref * sum L_hat_q
        assert m["duet_planned_tokens"] <= m["duet_budget"] + 1e-9
        assert m["duet_realised_tokens"] == m["tokens_generated"]
        assert m["rollouts"] == sum(int(n) * c for n, c in m["duet_n_hist"].items())
        for key in ("duet_lambda", "duet_k1", "duet_k2", "duet_abort_rate", "duet_weight_max"):
            assert key in m
    assert metrics[0]["duet_n_hist"] == {"4": 4}

    for r in rollouts:
        flags = r["flags"]
        assert {"marker", "eps_kept", "aborted"} <= flags.keys()
        if flags["aborted"]:
            # forced EOS at the gate K2 + grace = 24, zero weight (masked out of the loss)
            assert r["weight"] == 0.0 and flags["stop_at"] == 24 and r["length"] == 25
        else:
            assert r["weight"] > 0.0
        if flags["eps_kept"]:
            assert r["weight"] >= 2.0  # 1 / (s_pre * eps_abort) with s_pre <= 1
    assert any(r["flags"]["aborted"] for r in rollouts)
    assert any(r["flags"]["eps_kept"] for r in rollouts)

    # The resumed controller planned step 1 from the checkpointed DUET state of step 0.
    cfg = load_run_config(run)
    controller = TrainingController(
        group_size=cfg.generation.group_size, method=build_method(cfg).controller_state()
    )
    controller.load_state_dict(
        json.loads((run / "checkpoints" / "step_000000" / "controller.json").read_text())
    )
    step1 = [r["prompt_id"] for r in rollouts if r["step"] == 1]
    order = list(dict.fromkeys(step1))
    assert controller.plan_step(1, order)["n"] == dict(Counter(step1))
    assert len(set(Counter(step1).values())) > 1  # counts differ between prompts after warm-up
