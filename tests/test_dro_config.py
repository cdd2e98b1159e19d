"""The algorithm.dro config section: defaults (arXiv:2506.13351, Table 3 and App. F.2, with our
choices where the paper gives a range or an approximate value), validation naming the key, policy
wiring."""

from pathlib import Path

import pytest

from rlvr.config import ConfigError, load_config


def test_defaults():
    d = load_config(None, ["algorithm.name=dro"]).algorithm.dro
    assert (d.reward, d.omega, d.clip_low, d.clip_high) == ("r3", 1.5, 0.05, 0.85)
    assert (d.mu, d.rho_g, d.nu, d.rho_ent, d.beta) == (1, 0.25, 0.6, 0.4, 0.001)
    assert (d.delimiter, d.separator, d.scorer, d.judge) == (
        "</think>",
        "\n\n",
        "generator",
        "reference",
    )
    f = d.filter
    assert (f.group_size, f.token_frac, f.query_frac, f.retention) == (16, 0.1, 0.1, None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.name=dro", "algorithm.dro.omgea=1"], "algorithm.dro.omgea: unknown key"),
        (["algorithm.name=dro", "algorithm.dro.reward=rouge"], "algorithm.dro.reward"),
        (
            ["algorithm.name=dro", "algorithm.dro.clip_low=0.9"],
            "clip_low=0.9 must be <= clip_high=0.85",
        ),
        (["algorithm.name=dro", "algorithm.dro.rho_ent=0"], "algorithm.dro.rho_ent"),
        (
            ["algorithm.name=dro", "algorithm.dro.delimiter="],
            "gates judge the final answer after the delimiter",
        ),
        (
            ["algorithm.name=dro", "algorithm.dro.judge=keyword", "algorithm.dro.scorer=reference"],
            "needs the reference",
        ),
        (
            ["algorithm.name=dro", "algorithm.dro.filter.retention=0.05"],
            "retention=0.05 must be >= query_frac=0.1",
        ),
        (["algorithm.name=dro", "training.kl_coef=0.1"], "algorithm.dro.beta"),
        (
            ["algorithm.name=dro", "algorithm.dro.reward=verifier"],
            "runs without rubric gates",
        ),
    ],
)
def test_invalid_settings_fail_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_tiny_dro_preset_loads():
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny-dro.yaml")
    assert cfg.algorithm.name == "dro" and cfg.algorithm.dro.delimiter == "The answer is"
