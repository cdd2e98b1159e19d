"""DAPO (arXiv:2503.14476): dynamic sampling of informative groups on the step loop."""

from rlvr.methods.dapo.method import *  # noqa: F403  registers the method
