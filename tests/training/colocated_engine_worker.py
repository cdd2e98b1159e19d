"""A colocated engine in a process of its own, for the CUDA IPC hand-over test: it connects to the
test (address and key on the command line), scores, loads the rank's weights bucket by bucket as
`actors.generator` does, and scores again."""

from __future__ import annotations

import sys
from multiprocessing.connection import Client

import torch

from rlvr.generation.hf_backend import HFBackend
from rlvr.training.weight_sync import Bucket, SharedBucketReceiver, SharedBuffer


def main(host: str, port: str, authkey: str) -> None:
    with Client((host, int(port)), authkey=bytes.fromhex(authkey)) as conn:
        model_dir, buckets, sequences, positions = conn.recv()
        backend = HFBackend(model_dir, device="cuda")
        before = backend.score_logprobs(sequences, positions)

        def fetch(bucket: Bucket) -> SharedBuffer:
            conn.send("next")
            shared = conn.recv()
            if shared.tensor is not None:
                raise AssertionError("a bucket came as a copy, not as a CUDA IPC handle")
            return shared

        device = torch.device("cuda", torch.cuda.current_device())
        with SharedBucketReceiver(buckets, fetch, device) as received:
            backend.load_weights(received, names=received.names)
        conn.send((before, backend.score_logprobs(sequences, positions)))


if __name__ == "__main__":
    main(*sys.argv[1:])
