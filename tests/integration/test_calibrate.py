"""`rlvr calibrate` on vLLM, sized as told, on a machine where vLLM would not start by itself:
vLLM on CPU reads the memory it may use from the node, so the run below tells it that far less
than its default 90% share is free; a fixed KV cache starts anyway."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.integration.bounds import HANG_S

ROOT = Path(__file__).resolve().parents[2]

LOW_MEMORY = textwrap.dedent(
    """
    import sys

    import vllm.v1.worker.cpu_worker as cpu_worker
    from vllm.utils.cpu_resource_utils import MemoryNodeInfo

    real = cpu_worker.get_memory_node_info(0)
    free = min(real.available_memory, 2**30)  # 1 GiB: under the 90% vLLM claims by default
    assert free < 0.9 * real.total_memory
    cpu_worker.get_memory_node_info = lambda node=0: MemoryNodeInfo(real.total_memory, free)

    from workflows.cli import main

    sys.exit(main(sys.argv[1:]))
    """
)


def test_calibrate_starts_a_sized_vllm_engine_with_little_memory_free(tmp_path):
    out = tmp_path / "cal.json"
    argv = ["calibrate", "--checkpoint", "tiny", "--data", str(ROOT / "configs" / "tiny.yaml")]
    argv += ["--cal-fraction", "0.125", "--k", "2", "--max-tokens", "16", "--m", "4"]
    argv += ["--alpha", "0.5", "--out", str(out)]
    argv += ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-gib", "0.125"]
    argv += ["--enforce-eager", "--threads", "1"]
    done = subprocess.run(
        [sys.executable, "-c", LOW_MEMORY, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3 * HANG_S,  # 53 s quiet (2026-12-08): a bound on a hang only
    )
    log = done.stdout + done.stderr  # vLLM logs to stdout, before the command's JSON summary
    assert done.returncode == 0, log[-4000:]
    assert json.loads(done.stdout[done.stdout.rindex('{\n  "path"') :])["path"] == str(out)
    assert json.loads(out.read_text())["n_cal"] == 8  # 1/8 of the 64 held-out problems
    (engine,) = re.findall(r"non-default args: (\{.*\})", log)
    for setting in (
        "'dtype': 'float32'",
        "'max_model_len': 128",
        f"'kv_cache_memory_bytes': {2**27}",
        "'enforce_eager': True",
    ):
        assert setting in engine
    assert "Explicitly set (0.12/" in log  # the KV cache vLLM reports it allocated
