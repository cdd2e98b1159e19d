"""DRO (arXiv:2506.13351): the R3 reward, rubric gates and its loss on the step loop."""

from rlvr.methods.dro.method import *  # noqa: F403  registers the method
