"""One rank of a data-parallel PolicyTrainer run, started by test_policy_trainer as torchrun would.

The launcher sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; argv[1] is a JSON
spec: model_dir, settings (PolicyTrainer keywords), this rank's prompts / responses / advantages
(and optionally loss_masks / rollout_logprobs / weights), steps, and out (where rank 0 writes
the per-step metrics as JSON).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlvr.training.batch import build_batch
from rlvr.training.policy_trainer import PolicyTrainer


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)  # two ranks share the test machine's cores
    trainer = PolicyTrainer(spec["model_dir"], **spec["settings"])
    masks = spec.get("loss_masks")
    batch = build_batch(
        spec["prompts"],
        spec["responses"],
        pad_id=0,
        loss_masks=None if masks is None else [[bool(f) for f in m] for m in masks],
        rollout_logprobs=spec.get("rollout_logprobs"),
    )
    batch.advantages = torch.tensor(spec["advantages"])
    if "weights" in spec:
        batch.weights = torch.tensor(spec["weights"])
    metrics = [trainer.train_step(batch) for _ in range(spec["steps"])]
    if trainer.rank == 0:
        Path(spec["out"]).write_text(json.dumps(metrics))
    # Leave the group before exit: a rank torn down with live communication threads can abort
    # ("terminate called without an active exception") after its work is done.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
