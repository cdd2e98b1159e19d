"""Reward plug-ins for the tests (`verifier.function: tests.verifiers.reward_fns:<name>`)."""

import time

from rlvr.verifiers.code import CodeVerifier


def exact(prompts, responses, golds, metadata):
    """Plain floats: 1.0 for a response equal to its gold."""
    return [1.0 if r.strip() == g else 0.0 for r, g in zip(responses, golds, strict=True)]


def points(prompts, responses, golds, metadata):
    """(reward, status) pairs from the problem: its metadata's points, its prompt as status."""
    return [(float(m["points"]), p) for p, m in zip(prompts, metadata, strict=True)]


def call_size(prompts, responses, golds, metadata):
    """Each item's reward is the number of items in its call."""
    return [float(len(responses))] * len(responses)


def raises(prompts, responses, golds, metadata):
    raise RuntimeError("a broken reward function")


def sleeps(prompts, responses, golds, metadata):
    """Hangs on a call holding the response "sleep"."""
    if "sleep" in responses:
        time.sleep(600)
    return [1.0] * len(responses)


def short(prompts, responses, golds, metadata):
    return [1.0]


def bad_entries(prompts, responses, golds, metadata):
    return [0.5, float("nan"), "1.0", (1.0, "correct"), (0.0, 3)]


def code_in_sandbox(prompts, responses, golds, metadata):
    """Scores the responses' code against the golds' tests through the code verifier: a plug-in
    that runs model-written code does it in the sandbox, never in its own process."""
    with CodeVerifier(num_workers=2, timeout=5.0) as verifier:
        return verifier.verify_batch(responses, golds)


not_callable = 3
