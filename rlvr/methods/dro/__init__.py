"""DRO (arXiv:2506.13351): the R3 reward, rubric gates and its loss on the step loop."""
