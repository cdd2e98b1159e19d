"""SFT warm-up: loss on response tokens only, memorizes what it is shown (after chat-formatted or
raw prompts), cached by content."""

import json

import pytest

from rlvr.models.sft import (
    MARKER,
    _batch,
    boxed_answer_matches,
    greedy_accuracy,
    sft_warmup,
)
from rlvr.models.tiny import build_tiny_model
from rlvr.tasks import ArithmeticTask, Problem

PROBLEM = Problem(
    id="p", prompt="Compute 7 + 5.", answer="12", solution="7 + 5 = 12\nThe answer is \\boxed{12}."
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    corpus = list(ArithmeticTask(seed=0).corpus(200))
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0, corpus=corpus)


@pytest.fixture(scope="module")
def memorized(tiny, tmp_path_factory):
    """The tiny model fine-tuned on a single problem until it recites it."""
    out = tmp_path_factory.mktemp("sft") / "one"
    return sft_warmup(tiny, [PROBLEM], out, steps=40, lr=3e-3, batch_size=2, seed=0)


def test_batch_masks_the_prompt_and_padding():
    batch = _batch([([5, 6, 7], [8, 9]), ([5], [4])], pad_id=1)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 4, 1, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 8, 9], [-100, 4, -100, -100, -100]]


@pytest.mark.parametrize(
    ("response", "gold", "ok"),
    [
        ("so \\boxed{12}.", "12", True),
        ("\\boxed{ 1,200 }", "1200", True),
        ("\\boxed{$7$}", "7", True),
        ("\\boxed{12} then \\boxed{13}", "12", False),
        ("the answer is 12", "12", False),
        ("\\boxed{120}", "12", False),
    ],
)
def test_boxed_answer_matches(response, gold, ok):
    assert boxed_answer_matches(response, gold) is ok


def test_fresh_model_scores_zero_and_warm_up_learns_the_solution(tiny, memorized):
    assert greedy_accuracy(tiny, [PROBLEM], max_new_tokens=24) == 0.0
    assert greedy_accuracy(memorized, [PROBLEM], max_new_tokens=24) == 1.0
    record = json.loads((memorized / MARKER).read_text())
    assert record["steps"] == 40 and record["final_loss"] < 0.05


def test_raw_prompts_warm_up_for_raw_prompts(tiny, tmp_path):
    """With task.chat_template false the warm-up teaches the answer after the raw prompt."""
    raw = sft_warmup(
        tiny, [PROBLEM], tmp_path / "raw", steps=40, lr=3e-3, batch_size=2, chat_template=False
    )
    assert greedy_accuracy(tiny, [PROBLEM], max_new_tokens=24, chat_template=False) == 0.0
    assert greedy_accuracy(raw, [PROBLEM], max_new_tokens=24, chat_template=False) == 1.0
    assert json.loads((raw / MARKER).read_text())["chat_template"] is False


def test_cached_by_content(tiny, memorized):
    before = (memorized / "model.safetensors").stat().st_mtime_ns
    again = sft_warmup(tiny, [PROBLEM], memorized, steps=40, lr=3e-3, batch_size=2, seed=0)
    assert again == memorized
    assert (memorized / "model.safetensors").stat().st_mtime_ns == before


def test_other_inputs_are_not_served_from_cache(tiny, tmp_path):
    out = sft_warmup(tiny, [PROBLEM], tmp_path / "s", steps=2, lr=1e-3, batch_size=2, seed=0)
    first = json.loads((out / MARKER).read_text())["fingerprint"]
    other = Problem(id="q", prompt="Compute 1 + 1.", answer="2", solution="\\boxed{2}")
    for kwargs in ({"steps": 3}, {"seed": 1}, {"problems": [other]}, {"chat_template": False}):
        args = {"problems": [PROBLEM], "steps": 2, "seed": 0, **kwargs}
        sft_warmup(tiny, out_dir=out, lr=1e-3, batch_size=2, **args)
        assert json.loads((out / MARKER).read_text())["fingerprint"] != first


def test_warm_up_is_deterministic(tiny, tmp_path):
    a = sft_warmup(tiny, [PROBLEM], tmp_path / "a", steps=3, lr=1e-3, batch_size=2, seed=0)
    b = sft_warmup(tiny, [PROBLEM], tmp_path / "b", steps=3, lr=1e-3, batch_size=2, seed=0)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_rejects_problems_without_solutions(tiny, tmp_path):
    bare = Problem(id="b", prompt="Compute 1 + 1.", answer="2")
    with pytest.raises(ValueError, match="reference solution"):
        sft_warmup(tiny, [bare], tmp_path / "x", steps=1)
    with pytest.raises(ValueError, match="steps"):
        sft_warmup(tiny, [PROBLEM], tmp_path / "x", steps=0)
    assert not (tmp_path / "x").exists()


def test_warm_up_is_a_cache_hit_and_samples_box_their_answer(tiny, memorized, tmp_path):
    """A repeat warm-up returns the cached model untouched; the warmed model's sampled rollouts
    (T 0.9, top-p 0.95, as DUET's preset) write the \\boxed{} marker (bench/duet_warmup.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from duet_warmup import sample_stats

    stamp = (memorized / MARKER).stat().st_mtime_ns
    again = sft_warmup(tiny, [PROBLEM], memorized, steps=40, lr=3e-3, batch_size=2, seed=0)
    assert again == memorized and (memorized / MARKER).stat().st_mtime_ns == stamp
    stats = sample_stats(
        memorized, [PROBLEM], 8, 0.9, 0.95, 24, "Put your final answer in \\boxed{}."
    )
    assert stats["rollouts"] == 8 and stats["marker_rate"] >= 0.75
    assert stats["correct_tokens"]["n"] + stats["wrong_tokens"]["n"] == 8
