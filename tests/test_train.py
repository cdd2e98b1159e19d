"""The training workflow's pure parts: which held-out metric picks the best checkpoint, the resume
check on it, and the prompt-rendering check before any actor starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlvr.config import ConfigError, load_config
from rlvr.models.tiny import build_tiny_model
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
