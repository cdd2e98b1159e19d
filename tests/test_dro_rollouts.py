"""DRO over a step's rollouts: scoring ids spliced from token ids (never re-tokenized), group
rewards and gates, the batch of accepted groups, and the step metrics (arXiv:2506.13351: Sec. 3.1.1,
Eqs. 1-3, Sec. 4.1), on the hand-computed R3 case and hand-made rubric judgments."""

import numpy as np
import pytest

from rlvr.algorithms import dro
from rlvr.methods.dro.config import DroConfig
from rlvr.methods.dro.rollouts import (
    DroTokens,
    RejectionTally,
    dro_batch,
    reference_ids,
    reference_text,
    score_groups,
    scoring_inputs,
    step_metrics,
)
from rlvr.models.tiny import build_tiny_model
from rlvr.tasks.base import Problem
from rlvr.training.rollouts import Rollouts

TOKENS = DroTokens(delimiters=[[50, 51]], separator=[9], stop=frozenset({0}))
REFS = {"a": [7, 8, 10, 11], "b": [6]}
# hand-computed R3 case: G=4, L=4, rows 0/2 and 1/3 equal
P_A = np.array(
    [
        [0.95, 0.60, 0.50, 0.01],
        [0.95, 0.20, 0.50, 0.02],
        [0.95, 0.60, 0.50, 0.01],
        [0.95, 0.20, 0.50, 0.02],
    ]
)


def make_rollouts() -> Rollouts:
    responses = [
        [20, 21, 50, 51, 30, 0],  # CoT, delimiter, answer, EOS
        [22, 50, 51, 31, 0],
        [23, 24, 25],  # truncated, no delimiter
        [26, 50, 51, 32],
        [40, 50, 51, 41, 0],
        [42, 0],  # no delimiter: the whole completion is the prefix, no final answer
        [43, 50, 51, 44, 0],
        [45, 50, 51, 46, 0],
    ]
    n = len(responses)
    return Rollouts(
        group_ids=["a"] * 4 + ["b"] * 4,
        prompt_ids=[[1, 2]] * 4 + [[3]] * 4,
        response_ids=responses,
        texts=[""] * n,
        golds=["7"] * 4 + ["6"] * 4,
        finish_reasons=["stop", "stop", "length", "stop", "stop", "stop", "stop", "stop"],
        flags=[{}] * n,
    )


def test_scoring_inputs_splice_ids_and_slice_off_the_answer():
    inputs = scoring_inputs(make_rollouts(), REFS, TOKENS)
    assert inputs.sequences[0] == [1, 2, 20, 21, 50, 51, 9, 7, 8, 10, 11]
    assert inputs.positions[0] == [7, 8, 9, 10]
    assert inputs.answers[0] == [30]
    # truncated: scored with the whole completion as prefix, no final answer for the judge
    assert inputs.sequences[2] == [1, 2, 23, 24, 25, 7, 8, 10, 11]
    assert inputs.answers[2] is None
    # answer without EOS (stopped by length? no: finish 'stop' with no EOS) keeps its last token
    assert inputs.answers[3] == [32]
    assert inputs.sequences[5] == [3, 42, 6] and inputs.positions[5] == [2]
    assert inputs.answers[5] is None
    # only the sampled answer differs between rows 0 and a copy with another answer: same input
    other = make_rollouts()
    other.response_ids[0] = [20, 21, 50, 51, 99, 98, 0]
    assert scoring_inputs(other, REFS, TOKENS).sequences[0] == inputs.sequences[0]


def logprobs_for(rollouts):
    """Row log-probs: group a from the hand-computed P_A, group b constant."""
    rows = [list(np.log(p)) for p in P_A] + [[np.log(0.3)]] * 4
    return rows[: len(rollouts)]


def judged():
    a = [[True, True], [True, False], [True, True], [False, True]]
    b = [[False]] * 4  # item 0 met by no rollout: coverage fails
    return [np.array(r) for r in a + b]


def test_groups_scored_gated_and_batched():
    rollouts = make_rollouts()
    settings = DroConfig(omega=1.0)
    scores = score_groups(rollouts, settings, logprobs_for(rollouts), judged())
    a, b = scores["a"], scores["b"]
    np.testing.assert_allclose(a.rewards, [0.505479, 0.387344, 0.505479, 0.387344], atol=1e-6)
    # a two-valued group of 4: mean in the middle, sample std = gap / sqrt(3), eps 1e-4
    gap = 0.505479 - 0.387344
    adv = (gap / 2) / (gap / np.sqrt(3) + 1e-4)  # 0.864758
    np.testing.assert_allclose(a.advantages, [adv, -adv, adv, -adv], atol=1e-5)
    assert a.accepted and not b.coverage and not b.accepted
    assert b.rewards.tolist() == pytest.approx([0.3] * 4)

    batch, stats = dro_batch(rollouts, scores, pad_id=0)
    # group b is dropped; the truncated row 2 stays (it counts in the normaliser) with no loss
    assert len(batch) == 4
    assert batch.response_mask.sum(dim=1).tolist() == [6, 5, 0, 4]
    np.testing.assert_allclose(batch.advantages.numpy(), a.advantages, atol=1e-6)
    assert rollouts.weights.tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
    assert rollouts.statuses == ["accepted"] * 4 + ["no_coverage"] * 4
    np.testing.assert_allclose(rollouts.rewards[:4], a.rewards)
    assert stats["dro_train_sequences"] == 4 and stats["dro_trained_rollouts"] == 3

    tally = RejectionTally(groups=6, rejected=1)
    m = step_metrics(scores, tally, judge_failures=2, ungated_groups=0)
    assert m["dro_groups"] == 2 and m["dro_groups_rejected"] == 1
    assert m["dro_reject_rate"] == 0.5 and m["dro_reject_rate_cum"] == 2 / 8
    # group b's top rollout meets none of its items either: both gates fail, one rejection
    assert m["dro_coverage_failures"] == 1 and m["dro_consistency_failures"] == 1
    assert m["dro_judge_failures"] == 2
    assert m["dro_reward_mean"] == pytest.approx((a.rewards.mean() + 0.3) / 2)
    assert m["dro_prob_mean"] == pytest.approx((P_A.mean() + 0.3) / 2)
    assert m["dro_sbar_mean"] == pytest.approx((0.230940 + 0.0) / 2, abs=1e-6)
    assert RejectionTally.from_history([m, {"dro_groups": 6, "dro_groups_rejected": 1}]) == tally


def test_consistency_gate_uses_the_top_rollout_by_reward():
    rollouts = make_rollouts()
    rows = judged()
    rows[0] = np.array([False, True])  # the top R3 rollout (row 0) meets 1 of 2 < 60%
    scores = score_groups(rollouts, DroConfig(omega=1.0), logprobs_for(rollouts), rows)
    assert scores["a"].coverage and not scores["a"].consistency


def test_no_accepted_group_gives_a_batch_without_loss_tokens():
    rollouts = make_rollouts()
    rows = [np.zeros(2, dtype=bool)] * 4 + [np.zeros(1, dtype=bool)] * 4
    scores = score_groups(rollouts, DroConfig(), logprobs_for(rollouts), rows)
    batch, stats = dro_batch(rollouts, scores, pad_id=0)
    assert len(batch) == 8 and batch.num_loss_tokens == 0
    assert stats["dro_train_sequences"] == 0 and not rollouts.weights.any()


def test_gates_off_and_the_verifier_baseline():
    rollouts = make_rollouts()
    scores = score_groups(rollouts, DroConfig(gates=False), logprobs_for(rollouts))
    assert all(s.accepted for s in scores.values())
    settings = DroConfig(reward="verifier", gates=False)
    rewards = np.array([1.0, 0, 1, 0, 0, 0, 0, 0])
    scores = score_groups(rollouts, settings, rewards=rewards)
    np.testing.assert_allclose(scores["a"].advantages, dro.group_advantage([1, 0, 1, 0]))
    assert scores["b"].advantages.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="reference log-probs"):
        score_groups(rollouts, DroConfig(gates=False))


def test_reference_text_sources():
    p = Problem("x", "Compute 3 + 4.", "7", "3 + 4 = 7\nThe answer is \\boxed{7}.")
    assert reference_text(p, "The answer is") == " \\boxed{7}."
    assert reference_text(Problem("y", "q", "", reference="Paris."), "</think>") == "Paris."
    with pytest.raises(ValueError, match="no reference answer"):
        reference_text(p, "</think>")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


def test_delimiter_slicing_matches_in_context_tokenization(tokenizer):
    """With the arithmetic solution format, the tokens of the whole solution are exactly
    CoT + delimiter + reference as tokenized apart, so sliced scoring sees the trained ids."""
    tokens = DroTokens.from_tokenizer(tokenizer, "The answer is", "")
    assert tokens.separator == [] and tokens.stop == {tokenizer.eos_token_id}
    solution = "3 + 4 = 7\n6 + 1 = 7\nThe answer is \\boxed{7}."
    ids = tokenizer(solution, add_special_tokens=False)["input_ids"]
    ref = reference_ids(tokenizer, " \\boxed{7}.")
    delimiter = dro.match_delimiter(ids, tokens.delimiters)
    assert ids[-len(ref) - len(delimiter) :] == delimiter + ref
    cot, answer = dro.split_completion(ids, delimiter)
    assert answer == ref
    assert tokenizer.decode(cot) == "3 + 4 = 7\n6 + 1 = 7\n"


def test_delimiter_variants_find_it_after_a_space(tokenizer):
    """Byte-level BPE merges a leading space into the delimiter's first token (" \\boxed{" opens
    with the token " \\"), which the delimiter tokenized alone never matches."""
    tokens = DroTokens.from_tokenizer(tokenizer, "\\boxed{", "")
    alone = tokenizer("\\boxed{", add_special_tokens=False)["input_ids"]
    assert alone in tokens.delimiters and len(tokens.delimiters) > 1
    ids = tokenizer("2 + 3 = \\boxed{5}.", add_special_tokens=False)["input_ids"]
    assert dro.split_completion(ids, alone)[1] is None
    delimiter = dro.match_delimiter(ids, tokens.delimiters)
    cot, answer = dro.split_completion(ids, delimiter)
    assert tokenizer.decode(cot) == "2 + 3 ="
    assert tokenizer.decode(answer) == "5}."
    # no variant holds another, and each decodes to the delimiter after its context
    for v in tokens.delimiters:
        assert tokenizer.decode(v).endswith("\\boxed{")
        assert not any(u != v and dro.match_delimiter(v, [u]) for u in tokens.delimiters)
    assert DroTokens.from_tokenizer(tokenizer, "", "").delimiters == []
