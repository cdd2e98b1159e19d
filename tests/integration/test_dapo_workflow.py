"""DAPO dynamic sampling end to end on the tiny model through the actors: all-equal groups are
dropped, fresh prompts refill the step, and the step's cost counts every generated rollout."""

from __future__ import annotations

import json
from collections import defaultdict

# Temperature 1.5 spreads the SFT-warmed model's samples, so a round has both informative and
# all-equal groups; LACONIC's dual is left out (its step mean is undefined under dropping).
DAPO = [
    "algorithm.name=dapo",
    "algorithm.dapo.max_rounds=3",
    "generation.temperature=1.5",
    "run.steps=2",
]


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_dynamic_sampling_drops_flat_groups_and_counts_every_token(
    tmp_path, run_cli, tiny_train_args
):
    proc = run_cli(tiny_train_args(tmp_path, *DAPO))
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    run = tmp_path / "full"
    metrics = _lines(run / "metrics.jsonl")
    rollouts = _lines(run / "rollouts.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
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
