"""Tandem in the training step: the config section and its validation, the junior's directory,
and the shaping of co-written rollouts into a senior-only batch with the per-step metrics."""

import numpy as np
import pytest
import torch

from rlvr.algorithms.tandem import SwitchCounters
from rlvr.config import Config, ConfigError, config_from_dict, load_config
from rlvr.generation.tandem_support import counters_to_dict
from rlvr.methods.base import build_method
from rlvr.methods.tandem.shaping import junior_dir, shape_tandem
from rlvr.models.tiny import build_tiny_model
from rlvr.training.rollouts import Rollouts

TANDEM = load_config(None, ["algorithm.name=tandem"])


def test_config_defaults():
    # p = 0.5 is the paper's fair coin (arXiv:2606.28166, Sec. 3.3) and its KL loss is disabled
    # (App. A.3, Table 4); the cap of 32 follows the authors' code.
    cfg = load_config(None, ["algorithm.name=tandem"])
    t = cfg.algorithm.tandem
    assert (t.p, t.cap, t.junior_path) == (0.5, 32, None)
    assert cfg.training.kl_coef == 0.0


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"tandem": {"p": 0.0}}, "algorithm.tandem.p: Input should be greater than 0"),
        ({"tandem": {"p": 1.5}}, "algorithm.tandem.p: Input should be less than or equal to 1"),
        ({"tandem": {"cap": 0}}, "algorithm.tandem.cap: Input should be greater than or equal"),
        ({"tandem": {"coin": 1}}, "algorithm.tandem.coin: unknown key"),
    ],
)
def test_invalid_settings_name_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"algorithm": {"name": "tandem", **section}})


def test_the_presets_load():
    tandem = load_config("configs/tiny-tandem.yaml")
    assert tandem.algorithm.name == "tandem" and tandem.training.kl_coef == 0.0
    kl = load_config("configs/tiny-kl-junior.yaml")
    assert kl.algorithm.name == "grpo" and kl.training.kl_coef > 0.0


def test_the_junior_defaults_to_the_senior_start_and_is_checked(tmp_path):
    senior = build_tiny_model(tmp_path / "senior", seed=0)
    cfg = load_config(overrides=["algorithm.name=tandem"])
    assert junior_dir(cfg, senior) == senior
    tandem = {"junior_path": str(senior), "p": 0.5, "cap": 32, "junior": "shared"}
    assert build_method(cfg).generator_settings(senior) == {"tandem": tandem}
    assert build_method(Config()).generator_settings(senior) == {}
    assert not build_method(cfg).companion_engine()
    separate = load_config(
        overrides=[
            "algorithm.name=tandem",
            "algorithm.tandem.junior=separate",
            "generation.backend=hf",
        ]
    )
    assert build_method(separate).companion_engine()
    assert build_method(separate).companion_settings(senior) == {
        "model_path": str(senior),
        "tandem": {"p": 0.5, "cap": 32, "role": "junior"},
    }

    other = build_tiny_model(tmp_path / "other", seed=0, corpus=["zebra quokka yak"] * 20)
    for path, message in ((other, "tokenizers differ"), (tmp_path / "none", "neither")):
        junior = f"algorithm.tandem.junior_path={path}"
        cfg = load_config(overrides=["algorithm.name=tandem", junior])
        with pytest.raises(ConfigError, match=f"algorithm.tandem.junior_path: .*{message}"):
            junior_dir(cfg, senior)


def _rollouts(authorships, counters):
    return Rollouts(
        group_ids=["a", "a", "b", "b"],
        prompt_ids=[[1, 2], [1, 2], [3], [3]],
        response_ids=[[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]],
        texts=[""] * 4,
        golds=[""] * 4,
        finish_reasons=["stop"] * 4,
        flags=[{"tandem": counters_to_dict(c)} for c in counters],
        rewards=np.array([1.0, 0.0, 0.0, 0.0]),
        authorships=authorships,
    )


def test_shaping_keeps_the_senior_tokens_and_reports_the_schedule():
    authorships = [[1, 0, 0], [0], [1, 1, 0, 1], [1, 1]]
    counters = [
        SwitchCounters(boundary_redraws=2, cap_redraws=0, switches=1),
        SwitchCounters(boundary_redraws=0, cap_redraws=1, switches=0),
        SwitchCounters(boundary_redraws=3, cap_redraws=1, switches=2),
        SwitchCounters(boundary_redraws=1, cap_redraws=0, switches=0),
    ]
    batch, stats = shape_tandem(_rollouts(authorships, counters), TANDEM, pad_id=0)
    # prompt + response, right-padded to width 5; authorship sits after each prompt
    assert batch.authorship.tolist() == [
        [0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 1, 1, 0, 1],
        [0, 1, 1, 0, 0],
    ]
    assert batch.response_mask.tolist() == [
        [False, False, True, False, False],
        [False, False, False, False, False],
        [False, True, True, False, True],
        [False, True, True, False, False],
    ]
    # group a: rewards 1, 0 -> +-1/std; group b: all equal -> 0; every token of a row gets its A
    assert batch.advantages[2:].tolist() == [0.0, 0.0]
    assert batch.advantages[0] == -batch.advantages[1] > 0
    assert stats["tandem/senior_token_frac"] == 6 / 10
    assert stats["tandem/switches_per_seq"] == 3 / 4
    assert stats["tandem/mean_run_length"] == 10 / 7  # runs: 2 + 1 + 3 + 1
    assert stats["tandem/cap_redraw_share"] == 2 / 8
    assert torch.equal(batch.response_mask, batch.response_mask & (batch.authorship == 1))


def test_shaping_refuses_rollouts_without_authorship():
    counters = [SwitchCounters()] * 4
    with pytest.raises(ValueError, match="carry no authorship"):
        shape_tandem(_rollouts([[1, 1, 1], None, [1] * 4, [1, 1]], counters), TANDEM, 0)
    rollouts = _rollouts([[1, 1, 1], [1], [1] * 4, [1, 1]], counters)
    rollouts.flags[1] = {}
    with pytest.raises(ValueError, match="no tandem counters"):
        shape_tandem(rollouts, TANDEM, 0)
