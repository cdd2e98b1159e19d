"""Tandem RL: a frozen junior co-writes each rollout, only the senior trains."""
