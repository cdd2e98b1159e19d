"""The training workflow's pure parts: which held-out metric picks the best checkpoint, the resume
check on it, the prompt-rendering check before any actor starts, and a step whose rewards were
not computed (the verifier or an environment failed) failing before its update."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlvr.config import ConfigError, load_config
from rlvr.generation.base import GenerationResult, Sample
from rlvr.models.tiny import build_tiny_model
from rlvr.run.metrics import UncomputedRewards
from rlvr.run.rundir import RunDir
from rlvr.tasks import ArithmeticTask, Problem
from workflows.train import Trainer, best_metric, prepare

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize(
    ("preset", "overrides", "key"),
    [
        ("tiny.yaml", [], "eval_accuracy"),
        (
            "tiny.yaml",
            ["algorithm.name=laconic", "algorithm.laconic.budget=12"],
            "eval_accuracy",
        ),
        ("tiny-tandem.yaml", [], "eval_tandem_accuracy"),
        ("tiny-dro.yaml", [], "eval_r3"),
        (
            "tiny-dro.yaml",
            ["algorithm.dro.reward=verifier", "algorithm.dro.gates=false"],
            "eval_r3",
        ),
    ],
)
def test_best_metric_follows_the_method(preset, overrides, key):
    assert best_metric(load_config(CONFIGS / preset, overrides)) == key


def test_resume_refuses_a_best_step_picked_by_another_metric(tmp_path):
    cfg = load_config(CONFIGS / "tiny-tandem.yaml")
    run = RunDir(tmp_path / "run")
    run.create(cfg.to_dict())
    with run.writing_checkpoint(3) as d:
        progress = {"step": 3, "best_step": 3, "best_metric": "eval_accuracy"}
        (d / "progress.json").write_text(json.dumps(progress))
    problems = [Problem(id=str(i), prompt=f"Compute {i} + 1.", answer=str(i + 1)) for i in range(8)]
    trainer = Trainer(
        cfg, run, comps=None, tokenizer=None, train_problems=problems, test_problems=[]
    )
    with pytest.raises(ConfigError, match="by eval_accuracy, this configuration by eval_tandem"):
        trainer.restore(3)


def test_a_model_without_chat_template_needs_raw_prompts(tmp_path):
    corpus = list(ArithmeticTask(seed=0).corpus(100))
    model = build_tiny_model(tmp_path / "tiny", seed=0, corpus=corpus)
    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((bare / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    sets = [f"model.path={bare}", "generation.backend=hf", "task.n_train=8", "task.n_test=4"]
    with pytest.raises(ConfigError, match="has no chat template; set task.chat_template=false"):
        prepare(load_config(None, sets))
    model_dir, train, _ = prepare(load_config(None, [*sets, "task.chat_template=false"]))
    assert model_dir == bare and len(train) == 8


def test_lora_targets_must_name_layers_of_the_model(tmp_path):
    """The default targets fit the tiny Llama; GPT-2's names are refused before any actor starts,
    naming the key and the model's own layers."""
    corpus = list(ArithmeticTask(seed=0).corpus(100))
    model = build_tiny_model(tmp_path / "llama", seed=0, corpus=corpus, arch="llama")
    sets = [f"model.path={model}", "model.lora.enabled=true", "task.n_train=8", "task.n_test=4"]
    assert prepare(load_config(None, sets))[0] == model
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: none of .*q_proj"):
        prepare(load_config(None, [*sets, "model.lora.target_modules=[c_attn, c_fc]"]))


def test_a_chat_template_that_is_not_append_only_is_refused_for_multi_turn_rollouts(
    tmp_path, tiny_model_dir
):
    """A template that renders only the last two messages cannot keep a trajectory's ids past
    its first turn: refused at load, before any actor starts, naming the model and env.kind;
    single-turn rollouts do not need it, and the tiny model's own template passes."""
    forgetful = tmp_path / "forgetful"
    shutil.copytree(tiny_model_dir, forgetful)
    (forgetful / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((forgetful / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = (
        "{% for m in messages[-2:] %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    (forgetful / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    sets = ["generation.backend=hf", "task.n_train=8", "task.n_test=4"]
    tools = ["env.kind=tools", "env.tools=[rlvr.envs.builtin_tools:calculate]"]
    with pytest.raises(
        ConfigError,
        match=rf"{re.escape(str(forgetful))}.*env\.kind='tools'.*does not extend rendering messages",
    ):
        prepare(load_config(None, [f"model.path={forgetful}", *sets, *tools]))
    assert prepare(load_config(None, [f"model.path={forgetful}", *sets]))[0] == forgetful
    assert prepare(load_config(None, [f"model.path={tiny_model_dir}", *sets, *tools]))


def one_uncomputed(texts: list[str], golds: list[str]) -> list[tuple[float, str]]:
    """A verifier pool's scores where the first reward could not be computed."""
    return [(0.0, "verifier_failed")] + [(0.0, "wrong")] * (len(texts) - 1)


SAMPLE = Sample(token_ids=[1], text="\\boxed{1}", logprobs=[0.0], finish_reason="stop")


def fake_trainer(
    tmp_path: Path, samples: Callable[[int], list[Sample]], score: Callable
) -> Trainer:
    """A Trainer over 2 prompts x 2 samples (`samples(k)`: request k's, the first n of them) whose fake workers offer
    only what a step uses before its update (no policy, no weight sync); the verifier scores
    with `score`; verifier.max_uncomputed_share=0.2."""
    sets = [
        "generation.prompts_per_step=2",
        "generation.group_size=2",
        "task.chat_template=false",
        "verifier.max_uncomputed_share=0.2",
    ]
    cfg = load_config(CONFIGS / "tiny.yaml", sets)
    run = RunDir(tmp_path / "run")
    run.create(cfg.to_dict())
    problems = [Problem(id=str(i), prompt=f"Compute {i} + 1.", answer=str(i + 1)) for i in range(8)]
    comps = SimpleNamespace(
        controller=SimpleNamespace(plan_step=lambda step, ids: {"n": dict.fromkeys(ids, 2)}),
        generator=SimpleNamespace(
            generate=lambda requests, params, step: [
                GenerationResult(r.request_id, r.prompt_ids, samples(k)[: r.n])
                for k, r in enumerate(requests)
            ]
        ),
        verifier=SimpleNamespace(score=score),
    )
    return Trainer(
        cfg,
        run,
        comps,
        tokenizer=lambda text: {"input_ids": [1, 2, 3]},
        train_problems=problems,
        test_problems=problems[:2],
    )


def test_a_step_past_the_uncomputed_share_fails_before_its_update(tmp_path):
    """One reward of 4 uncomputed: 0.25 > max_uncomputed_share=0.2."""
    trainer = fake_trainer(tmp_path, lambda k: [SAMPLE] * 2, one_uncomputed)
    message = r"^step 5: 1 of 4 rewards uncomputed \(share 0\.25 > "
    with pytest.raises(UncomputedRewards, match=message + r"verifier\.max_uncomputed_share=0\.2\)"):
        trainer.step(5)
    with pytest.raises(UncomputedRewards, match=r"^evaluation at step 5: 1 of 2 rewards"):
        trainer.evaluate(5)
    assert not trainer.run.read_metrics() and not trainer.run.completed_steps()


def test_a_failed_environment_is_not_scored_and_counts_toward_the_uncomputed_share(tmp_path):
    """Per prompt, one trajectory ends well and one fails on the environment's side (prompt 0's
    environment crashed, prompt 1's callback timed out): the verifier never sees the failed ones,
    whose rewards are uncomputed, not 0; 2 of 4 > 0.2 stops the step, naming the statuses."""
    failed = ["env_crashed", "callback_timeout"]

    def samples(k: int) -> list[Sample]:
        record = {"turns": 1, "tool_calls": 0, "tool_errors": 0, "end_reason": failed[k]}
        record["env_reward"] = 1.0  # a reward given before the failure does not stand either
        return [SAMPLE, replace(SAMPLE, text="<tool_call>", flags={"agent": record})]

    seen: list[str] = []

    def score(texts: list[str], golds: list[str]) -> list[tuple[float, str]]:
        seen.extend(texts)
        return [(1.0, "correct")] * len(texts)

    trainer = fake_trainer(tmp_path, samples, score)
    rollouts = trainer.services.generate(
        trainer.train_problems[:2], {"0": 2, "1": 2}, trainer.sampling_params(5), 5
    )
    trainer.services.verify(rollouts)
    assert seen == ["\\boxed{1}"] * 2
    assert rollouts.statuses == ["correct", "env_crashed", "correct", "callback_timeout"]
    assert list(rollouts.rewards) == [1.0, 0.0, 1.0, 0.0]  # 0.0: a placeholder, trained on by none
    message = (
        r"^step 5: 2 of 4 rewards uncomputed \(share 0\.5 > verifier\.max_uncomputed_share=0\.2\), "
        r"by status: callback_timeout 1, env_crashed 1; the step is not committed"
    )
    with pytest.raises(UncomputedRewards, match=message):
        trainer.step(5)
