"""Reward functions: answer extraction and verifiers that score responses against a gold."""

VERIFIER_FAILED = "verifier_failed"
"""The status of a reward that could not be computed: the verifier itself kept failing on the item
(its actor died or hung on every run). Unlike "timeout" or "error", which are the math verifier's
verdict on an answer, it says nothing about the answer; its reward of 0.0 is a placeholder."""
