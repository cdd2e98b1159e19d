"""DUET (arXiv:2605.08441): per-prompt rollout counts and in-engine early aborts on the step loop."""
