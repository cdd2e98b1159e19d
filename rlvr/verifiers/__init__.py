"""Reward functions: answer extraction and verifiers that score responses against a gold."""
