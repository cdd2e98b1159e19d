"""bench/tandem.py's critical-path count of the two Tandem forms, on hand-built authorships."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # as when it runs as a script: its folder's modules on the path
SPEC = importlib.util.spec_from_file_location("bench_tandem", BENCH / "tandem.py")
tandem_bench = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = tandem_bench
SPEC.loader.exec_module(tandem_bench)


def test_round_steps_hand_values():
    # runs: a = S3 J1 S1 (5 tokens), b = J1 S4 (5 tokens), c = S2 (2 tokens)
    a = [1, 1, 1, 0, 1]
    b = [0, 1, 1, 1, 1]
    c = [1, 1]
    assert tandem_bench.round_steps([a, b, c]) == {
        "shared_steps": 5,
        "rounds": 3,
        # round 0: max(3, 1, 2) = 3; round 1: max(1, 4) = 4; round 2: 1
        "critical_steps": 8,
        # a: 5 tokens + 2 switches, b: 5 + 1, c: 2 + 0
        "continuous_steps": 7,
    }


def test_two_gpu_projection_hand_values():
    steps = {"shared_steps": 5, "rounds": 3, "critical_steps": 8, "continuous_steps": 7}
    assert tandem_bench.two_gpu_projection(steps) == {
        "shared": 2.0,
        "separate_rounds": 8 / 5,
        "separate_continuous": 7 / 5,
    }
