"""Tandem RL: a frozen junior co-writes each rollout, only the senior trains."""

from rlvr.methods.tandem.method import *  # noqa: F403  registers the method
