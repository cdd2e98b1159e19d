"""One of two ranks set up as a run's PolicyActor and engine set theirs up on one node: collectives
bound to the loopback, DeepSpeed's process group (`init_distributed`), then the weight sync's
group, rank 0 serving its store. Prints READY and keeps every listener open until stdin closes.

The launcher sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as rank_environments
does.
"""

import sys

import torch
import torch.distributed as dist

from rlvr.training import weight_sync
from rlvr.training.policy_trainer import init_distributed
from rlvr.training.rendezvous import LOOPBACK, bind_collectives


def main() -> None:
    bind_collectives(LOOPBACK)
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    port = [0]
    if rank == 0:
        store = weight_sync.serve_store(LOOPBACK, world_size, timeout_s=30)
        port = [store.port]
    dist.broadcast_object_list(port, src=0)
    if rank > 0:
        store = weight_sync.join_store(LOOPBACK, port[0], world_size, timeout_s=30)
    weight_sync.open_group(rank, world_size, torch.device("cpu"), store)
    print("READY", flush=True)
    sys.stdin.read()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
