"""verifier.kind "code" through the config, the in-process VerifierActor and a Ray VerifierPool."""

import json

import pytest

from actors.verifier import VerifierActor, VerifierPool
from rlvr.config import ConfigError, config_from_dict
from rlvr.verifiers.factory import make_verifier

GOLD = json.dumps({"asserts": ["assert f(2) == 7", "assert f(0) == 1"]})
RESPONSES = [
    "```python\ndef f(x):\n    return 3 * x + 1\n```",
    "```python\ndef f(x):\n    return x\n```",
    "no code here, just words",
    "```python\nwhile True:\n    pass\n```",
]
SCORED = [(1.0, "correct"), (0.0, "wrong"), (0.0, "error"), (0.0, "timeout")]


def test_config_accepts_code_and_rejects_unknown_kinds():
    assert config_from_dict({"verifier": {"kind": "code"}}).verifier.kind == "code"
    with pytest.raises(ConfigError):
        config_from_dict({"verifier": {"kind": "sql"}})
    with pytest.raises(ValueError):
        make_verifier("sql")


def test_in_process_actor_scores_code():
    actor = VerifierActor(2.0, num_workers=2, kind="code")
    try:
        assert actor.score(RESPONSES, [GOLD] * len(RESPONSES)) == SCORED
    finally:
        actor.verifier.close()


def test_pool_scores_code(ray_cluster):
    pool = VerifierPool(size=2, timeout_s=2.0, kind="code")
    try:
        assert pool.score(RESPONSES, [GOLD] * len(RESPONSES)) == SCORED
        assert pool.replaced == 0
    finally:
        pool.shutdown()
