"""bench/engine_mismatch.py's --dtype gives the engine and the trainer the same weights dtype, so
that it measures the ratio at identical bf16 weights."""

import importlib.util
import sys
from pathlib import Path

import pytest

from rlvr.config import load_config

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # as when it runs as a script: its folder's harness on the path
SPEC = importlib.util.spec_from_file_location("bench_engine_mismatch", BENCH / "engine_mismatch.py")
engine_mismatch = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(engine_mismatch)


@pytest.mark.parametrize("preset", ["tiny", "smollm2-arith"])
def test_dtype_sets_both_sides(preset):
    config = BENCH.parent / "configs" / f"{preset}.yaml"
    cfg = load_config(config, engine_mismatch.dtype_overrides("bfloat16"))
    assert (cfg.model.dtype, cfg.engine_dtype) == ("bfloat16", "bfloat16")
    # without it, each side keeps the preset's own dtype
    default = load_config(config, engine_mismatch.dtype_overrides(None))
    assert (default.model.dtype, default.engine_dtype) == ("float32", "float32")


def test_the_table_reports_the_outside_share():
    assert "engine_outside_frac" in engine_mismatch.COLUMNS
