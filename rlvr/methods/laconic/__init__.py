"""LACONIC (Liu et al.): a mean length budget as a constraint with an adaptive dual, on the step loop."""

from rlvr.methods.laconic.method import *  # noqa: F403  registers the method
