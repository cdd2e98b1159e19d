"""Shared fixtures: one Ray cluster per test session, bound to 127.0.0.1, and an isolated model cache."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's Ray cluster (started once: each start costs seconds)."""
    import ray

    from actors.controller import NAMESPACE

    if not ray.is_initialized():
        ray.init(
            num_cpus=os.cpu_count() or 2,
            namespace=NAMESPACE,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()
