"""DUET (arXiv:2605.08441): per-prompt rollout counts and in-engine early aborts on the step loop."""

from rlvr.methods.duet.method import *  # noqa: F403  registers the method
