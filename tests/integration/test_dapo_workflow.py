"""DAPO dynamic sampling end to end on the tiny model through the actors: all-equal groups are
dropped, fresh prompts refill the step, and the step's cost counts every generated rollout. The
run is ended by Ctrl-C, as a user ends it: it stops after the step in progress commits, and
leaves nothing of its cluster running."""

from __future__ import annotations

import json
import signal
from collections import defaultdict

import psutil

from rlvr.run.rundir import RunDir

# Temperature 1.5 spreads the SFT-warmed model's samples, so a round has both informative and
# all-equal groups; LACONIC's dual is left out (its step mean is undefined under dropping). Ctrl-C
# comes once step 0 commits, so the run stops after step 1 (step 2 if the signal lands after
# step 1 began), never at its last step, which would end it as finished.
DAPO = [
    "algorithm.name=dapo",
    "algorithm.dapo.max_rounds=3",
    "generation.temperature=1.5",
    "run.steps=4",
]


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_dynamic_sampling_drops_flat_groups_and_ctrl_c_stops_after_the_step(
    tmp_path, run_cli, tiny_train_args, run_control
):
    run = tmp_path / "full"
    proc = run_cli(tiny_train_args(tmp_path, *DAPO))
    run_control.wait_for_commit(proc, run / "checkpoints" / "step_000000", poll_s=0.01)
    cluster, _ = run_control.cluster_of(psutil.Process(proc.pid))
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=600)  # the reaper holds the pipe until it is done
    assert proc.returncode == 130, out[-4000:]
    assert "rlvr: Ctrl-C: stopping after the current step (Ctrl-C again to stop now)" in out
    last = RunDir(run).last_completed_step()
    assert 1 <= last < 3, out[-4000:]
    assert (
        f"rlvr: stopped by SIGINT after the current step; its last committed step is {last}: "
        f"`rlvr train --resume {run}` continues from there" in out
    )
    # Every step that ran was committed whole: its log lines and its checkpoint, nothing after.
    metrics = _lines(run / "metrics.jsonl")
    rollouts = _lines(run / "rollouts.jsonl")
    assert [m["step"] for m in metrics] == list(range(last + 1))
    assert {r["step"] for r in rollouts} == set(range(last + 1))
    assert not list((run / "checkpoints").glob(".staging_*"))
    assert run_control.alive(cluster) == []

    for m in metrics:
        step_rows = [r for r in rollouts if r["step"] == m["step"]]
        groups: dict[str, list[float]] = defaultdict(list)
        for r in step_rows:
            groups[r["prompt_id"]].append(r["reward"])
        informative = sum(min(g) != max(g) for g in groups.values())
        # every generated rollout is logged and paid for, dropped groups included
        assert len(step_rows) == m["rollouts"] == 4 * len(groups)
        assert m["tokens_generated"] == sum(r["length"] for r in step_rows)
        assert m["dapo_kept_groups"] + m["dapo_dropped_groups"] == len(groups)
        # refills draw exactly the missing count, so every informative group is kept, up to 4
        assert m["dapo_kept_groups"] == min(informative, 4)
        assert 1 <= m["dapo_rounds"] <= 3
        # a refill round ran only if the rounds before it fell short of 4 informative groups
        assert (m["dapo_rounds"] == 1) == (len(groups) == 4)
        assert m["dapo_rounds"] == 3 or m["dapo_kept_groups"] == 4
