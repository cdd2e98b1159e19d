"""Where a trainer's DeepSpeed state lies in a checkpoint directory, and its conversion into
DeepSpeed's universal checkpoint so that another number of policy ranks can resume it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

STATE_TAG = "state"
"""The DeepSpeed checkpoint tag of the trainer's own state (weights, optimizer, lr schedule)."""
UNIVERSAL_TAG = "state_universal"
"""The tag of its universal conversion, made once beside it when the rank count changes."""


def saved_ranks(directory: Path) -> int:
    """How many ZeRO ranks wrote the state under ``directory`` (0 for stage 0)."""
    return len(list((directory / STATE_TAG).glob("*zero_pp_rank_*_optim_states.pt")))


def to_universal(state: Path, out: Path) -> None:
    """DeepSpeed's conversion of a ZeRO state into a universal checkpoint (written beside, then
    renamed into place, so a half-written conversion is never loaded)."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    args = ["--input_folder", str(state), "--output_folder", str(partial)]
    args += ["--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    done = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", *args],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"cannot convert {state} (saved by another number of policy ranks) into a universal "
            f"checkpoint; resume with the rank count it was saved with:\n{done.stderr[-2000:]}"
        )
    partial.rename(out)
