"""One real GRPO update in one process: vLLM samples -> math-verify rewards -> DeepSpeed step -> sync."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlvr.config import load_config
from workflows.train import prepare


@pytest.fixture(scope="module")
def warm_model(tiny_config):
    """The tiny preset's SFT-warmed model (built once per machine, shared with the other tests)."""
    return prepare(load_config(tiny_config))[0]


def test_grpo_update_with_vllm_samples_and_verifier_rewards(warm_model):
    """Sample with vLLM, reward with math-verify, step DeepSpeed, sync into the engine: see the script."""
    script = Path(__file__).with_name("grpo_update_check.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(warm_model)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "grpo update check passed" in proc.stdout
