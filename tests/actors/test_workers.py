"""Worker: one call surface over actors and local objects; actor crashes name the actor and step."""

import pytest
import ray

from workflows.workers import ActorFailure, Worker


class Echo:
    def twice(self, x):
        return 2 * x

    def boom(self):
        raise ValueError("bad batch")


def test_local_and_actor_give_the_same_results(ray_cluster):
    local = Worker(Echo(), "Echo")
    remote = Worker(ray.remote(Echo).remote(), "EchoActor")
    assert local.run("twice", 21) == remote.run("twice", 21) == 42


def test_actor_crash_names_actor_and_step(ray_cluster):
    remote = Worker(ray.remote(Echo).remote(), "PolicyActor")
    with pytest.raises(ActorFailure, match=r"PolicyActor failed at step 7: ValueError: bad batch"):
        remote.run("boom", step=7)
