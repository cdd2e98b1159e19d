"""DAPO dynamic sampling: which groups a round keeps, the refill count, the refill draw, the
config section, and the Rollouts row operations the Trainer's refill loop builds its batch with."""

from __future__ import annotations

import numpy as np
import pytest

from rlvr.algorithms.dapo import informative_groups, refill_indices, sift_round
from rlvr.config import ConfigError, load_config
from rlvr.training.rollouts import Rollouts


def test_informative_groups_drops_all_equal_and_singletons():
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.0]
    ids = ["a", "a", "b", "b", "c", "c", "d", "e", "e", "a"]
    assert informative_groups(rewards, ids) == (["a"], ["b", "c", "d", "e"])
    with pytest.raises(ValueError, match="3 rewards for 2"):
        informative_groups([0.0, 1.0, 1.0], ["a", "a"])


def test_sift_round_keeps_informative_and_asks_for_the_deficit():
    # a and c informative, b and d all-equal: 2 of 4 kept, the next round draws 2 prompts
    first = sift_round([1, 0, 1, 1, 0, 1, 0, 0], list("aabbccdd"), 0, 4, 0, 3)
    assert (first.kept, first.dropped, first.refill) == (["a", "c"], ["b", "d"], 2)
    second = sift_round([1, 0, 0, 1], list("eeff"), 2, 4, 1, 3)
    assert (second.kept, second.dropped, second.refill) == (["e", "f"], [], 0)


def test_sift_round_trims_surplus_and_stops_at_the_last_round():
    # one group missing, two informative ones arrive: the first is kept, the second dropped
    surplus = sift_round([1, 0, 0, 1], list("gghh"), 3, 4, 1, 3)
    assert (surplus.kept, surplus.dropped, surplus.refill) == (["g"], ["h"], 0)
    # the last round asks for nothing even though the step is short
    last = sift_round([1, 1, 0, 0], list("iijj"), 1, 4, 2, 3)
    assert (last.kept, last.dropped, last.refill) == ([], ["i", "j"], 0)
    with pytest.raises(ValueError, match="max_rounds=3"):
        sift_round([1, 0], list("kk"), 0, 4, 3, 3)
    with pytest.raises(ValueError, match="have=5"):
        sift_round([1, 0], list("kk"), 5, 4, 0, 3)


def test_refill_indices_are_fresh_deterministic_and_capped():
    draw = refill_indices(1000, 10, [0, 1, 2], seed=7, step=5, round_index=1)
    assert len(draw) == len(set(draw)) == 10 and not {0, 1, 2} & set(draw)
    assert draw == refill_indices(1000, 10, [0, 1, 2], seed=7, step=5, round_index=1)
    assert draw != refill_indices(1000, 10, [0, 1, 2], seed=7, step=5, round_index=2)
    assert draw != refill_indices(1000, 10, [0, 1, 2], seed=7, step=6, round_index=1)
    # asking for more than the pool has left returns exactly what is left
    assert sorted(refill_indices(6, 10, {0, 2, 4}, seed=0, step=0, round_index=1)) == [1, 3, 5]
    assert refill_indices(6, 0, [], seed=0, step=0, round_index=1) == []


def test_config_section():
    assert load_config(None, ["algorithm.name=dapo"]).algorithm.dapo.max_rounds == 3
    with pytest.raises(ConfigError, match=r"algorithm\.dapo\.max_rounds"):
        load_config(None, ["algorithm.name=dapo", "algorithm.dapo.max_rounds=0"])


def _rollouts(groups: list[str], rewards: list[float] | None = None) -> Rollouts:
    n = len(groups)
    out = Rollouts(
        group_ids=groups,
        prompt_ids=[[1]] * n,
        response_ids=[[10 + i] for i in range(n)],
        texts=[f"t{i}" for i in range(n)],
        golds=["1"] * n,
        finish_reasons=["stop"] * n,
        flags=[{}] * n,
    )
    if rewards is not None:
        out.rewards = np.array(rewards)
        out.statuses = ["ok"] * n
    return out


def test_rollouts_concat_take_and_rows_of():
    first = _rollouts(["a", "a", "b", "b"], [1.0, 0.0, 1.0, 1.0])
    second = _rollouts(["c", "c"], [0.0, 1.0])
    every = Rollouts.concat([first, second])
    assert every.group_ids == ["a", "a", "b", "b", "c", "c"]
    assert every.texts == ["t0", "t1", "t2", "t3", "t0", "t1"]
    assert every.rewards.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert len(every.advantages) == 0  # not filled in any part: stays empty
    rows = every.rows_of(["c", "a"])
    assert rows == [4, 5, 0, 1]
    kept = every.take(rows)
    assert kept.group_ids == ["c", "c", "a", "a"]
    assert kept.response_ids == [[10], [11], [10], [11]]
    assert kept.rewards.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert kept.statuses == ["ok"] * 4
    assert len(every.take([])) == 0
    with pytest.raises(ValueError, match="rewards is filled in some parts only"):
        Rollouts.concat([first, _rollouts(["d", "d"])])
