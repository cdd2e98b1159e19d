"""Multi-turn rollouts in an environment on a real engine (the transformers backend, the engines'
reference): each trajectory's token layout, its seeds, and every way an environment can end one."""

from __future__ import annotations

import pytest

from rlvr.envs.rollout import AGENT_FLAGS, AgentRequest, Agents, EnvSettings, agent_failure
from rlvr.generation.base import Sample, SamplingParams
from rlvr.generation.engine_loop import FinishedTurn, TurnRequest, run_trajectories
from rlvr.generation.hf_backend import HFBackend
from rlvr.tasks.base import Problem
from tests.envs import sample_envs

PROBLEMS = [Problem(id="p0", prompt="What is 2 + 3?", answer="5"), Problem("p1", "1 + 1?", "2")]
PARAMS = SamplingParams(temperature=1.0, max_tokens=6, seed=0)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFBackend(tiny_model_dir)


def settings(**kw) -> EnvSettings:
    base = {"kind": "python", "env_class": "tests.envs.sample_envs:GuessTheAnswer"}
    return EnvSettings(**{**base, "kwargs": {"tries": 3}, "max_turns": 4, **kw})


def run(engine, env: EnvSettings, n: int = 2):
    requests = [AgentRequest(p, n=n, seed=100 * i, request_id=p.id) for i, p in enumerate(PROBLEMS)]
    return Agents(env, engine.tokenizer).generate(engine, requests, PARAMS, max_model_len=256)


def test_trajectories_interleave_the_model_s_tokens_with_the_environment_s(engine):
    results = run(engine, settings())
    assert [r.request_id for r in results] == ["p0", "p0", "p1", "p1"]
    for result in results:
        [sample] = result.samples
        record = sample.flags[AGENT_FLAGS]
        # the tiny model never guesses right: three turns, then the environment's reward 0
        assert record["turns"] == 3 and record["end_reason"] == "done"
        assert record["env_reward"] == 0.0 and record["tool_calls"] == 0
        mask = sample.model_tokens
        assert len(mask) == len(sample.token_ids) == len(sample.logprobs)
        # the model's tokens are sampled ones (a log-prob of their own), the hints' ids are not
        observed = [lp for lp, own in zip(sample.logprobs, mask, strict=True) if not own]
        assert observed and all(lp == 0.0 for lp in observed)
        assert sum(mask) <= 3 * PARAMS.max_tokens
        hints = engine.tokenizer.decode(
            [t for t, own in zip(sample.token_ids, mask, strict=True) if not own]
        )
        assert "2 tries left" in hints and "1 tries left" in hints
    # the same seeds sample the same trajectories
    again = run(engine, settings())
    assert [r.samples[0].token_ids for r in again] == [r.samples[0].token_ids for r in results]


@pytest.mark.parametrize(
    ("how", "reason", "turns"),
    [
        ("reset raises", "env_error", 0),
        ("reset gives a str", "env_bad_result", 0),
        ("raises", "env_error", 1),
        ("hangs", "env_timeout", 1),
        ("dies", "env_crashed", 1),
        ("speaks for the assistant", "env_bad_result", 1),
    ],
)
def test_a_failing_environment_ends_its_trajectory_with_its_status(engine, how, reason, turns):
    env = settings(env_class="tests.envs.sample_envs:Failing", kwargs={"how": how})
    env = EnvSettings(**{**env.__dict__, "env_timeout_s": 2.0})
    results = run(engine, env, n=1)
    for result in results:
        [sample] = result.samples
        record = sample.flags[AGENT_FLAGS]
        assert (record["end_reason"], record["turns"]) == (reason, turns)
        assert agent_failure(sample.flags) == reason  # its reward is uncomputed, not scored
        assert result.prompt_ids  # a prompt of its own even when the environment never started
        if turns == 0:
            assert sample.token_ids == [] and sample.model_tokens == []


def test_the_engine_loop_s_callback_ends_are_failures_and_the_model_s_limits_are_not():
    """A callback that raised or hung failed on the environment's side; a trajectory that ran
    out of turns, tokens or context ended by the model's doing, and is scored."""
    for reason in ("callback_error", "callback_timeout"):
        assert agent_failure({AGENT_FLAGS: {"end_reason": reason}}) == reason
    for reason in ("done", "max_turns", "token_budget", "context_length"):
        assert agent_failure({AGENT_FLAGS: {"end_reason": reason}}) is None
    assert agent_failure({}) is None  # a single-turn rollout


def test_the_token_budget_ends_a_trajectory(engine):
    """An environment that never ends, and more turns allowed than the budget has tokens (a turn
    samples one token at least): the budget ends every trajectory, at exactly its size, summed
    over its turns (one samples `PARAMS.max_tokens` = 6 at most)."""
    budget = 8
    env = settings(
        env_class="tests.envs.sample_envs:Endless",
        kwargs={},
        max_turns=budget + 1,
        token_budget=budget,
    )
    for result in run(engine, env, n=1):
        [sample] = result.samples
        record = sample.flags[AGENT_FLAGS]
        assert (record["end_reason"], sum(sample.model_tokens)) == ("token_budget", budget)
        assert record["turns"] >= 2


CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "47 * 86"}}\n</tool_call>'
UNKNOWN = '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>'


class ScriptedPolicy:
    """The engine loop's `TurnEngine` with a policy that writes a fixed text per turn (the tiny
    model never writes a tool call): the first turn calls the calculator, the second an unknown
    tool, the third answers. Everything after the text (the loop, the parser, the sandboxed
    tools, the splicing) is the real path."""

    rounds = True
    vocab_size = 2048

    def __init__(self, tokenizer, texts: tuple[str, ...] = (CALL, UNKNOWN, "\\boxed{4042}")):
        self.tokenizer = tokenizer
        self.texts = texts
        self.context_limit = 4096
        self.submitted: list[tuple[int, TurnRequest]] = []

    def submit(self, key: int, request: TurnRequest) -> None:
        self.submitted.append((key, request))

    def poll(self) -> list[FinishedTurn]:
        done, self.submitted = self.submitted, []
        out = []
        for key, request in done:
            results = self.tokenizer.decode(request.prompt_ids).count("<tool_response>\n")
            text = self.texts[min(results, len(self.texts) - 1)]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids.append(self.tokenizer.eos_token_id)
            out.append(FinishedTurn(key, Sample(ids, text, [-0.5] * len(ids), "stop")))
        return out

    def in_flight(self) -> int:
        return len(self.submitted)

    def abort(self) -> None:
        self.submitted = []

    def generate_trajectories(
        self, trajectories, params, limits=None, schedule=None, segments=None
    ):
        return run_trajectories(self, trajectories, params, limits, segments=segments)


def test_tool_calls_run_sandboxed_and_return_as_observations_the_model_does_not_train_on(engine):
    tools = EnvSettings(kind="tools", tools=("rlvr.envs.builtin_tools:calculate",), max_turns=4)
    policy = ScriptedPolicy(engine.tokenizer)
    problem = Problem("p", "Compute 47 * 86.", "4042")
    [result] = Agents(tools, engine.tokenizer).generate(
        policy, [AgentRequest(problem, n=1, seed=0, request_id="p")], SamplingParams(max_tokens=64)
    )
    [sample] = result.samples
    record = sample.flags[AGENT_FLAGS]
    assert record == {
        "turns": 3,
        "tool_calls": 2,
        "tool_errors": 1,  # the unknown tool: an error the model reads, not a failed rollout
        "end_reason": "done",
        "env_reward": None,  # no reward of the loop's own: the verifier scores the answer
        "repaired_chars": 0,
    }
    assert sample.text == "\\boxed{4042}"
    tokenizer = engine.tokenizer
    own = [t for t, m in zip(sample.token_ids, sample.model_tokens, strict=True) if m]
    observed = tokenizer.decode(
        [t for t, m in zip(sample.token_ids, sample.model_tokens, strict=True) if not m]
    )
    written = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (CALL, UNKNOWN)]
    assert own == written[0] + [tokenizer.eos_token_id] + written[1] + [tokenizer.eos_token_id] + (
        tokenizer("\\boxed{4042}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    )
    assert "<tool_response>\n4042\n</tool_response>" in observed
    assert "Error: no tool named 'lookup' (tools: calculate)" in observed


def observed_text(tokenizer, sample: Sample) -> str:
    """The decoded ids of a trajectory that the model did not sample."""
    own = sample.model_tokens
    return tokenizer.decode([t for t, m in zip(sample.token_ids, own, strict=True) if not m])


def test_a_tool_result_the_tokenizer_cannot_encode_is_repaired_and_counted(engine):
    """A snippet prints a lone surrogate from plain ASCII source: the result is "ok", and the
    tokenizer cannot encode it; the trajectory goes on with U+FFFD in its place."""
    tools = EnvSettings(kind="tools", tools=("rlvr.envs.builtin_tools:python",), max_turns=4)
    snippet = "print('\\\\ud800 and \\\\udcff')"  # ASCII source: the escapes make the surrogates
    call = f'<tool_call>\n{{"name": "python", "arguments": {{"code": "{snippet}"}}}}\n</tool_call>'
    policy = ScriptedPolicy(engine.tokenizer, (call, "\\boxed{1}"))
    problem = Problem("p", "Print something.", "1")
    [result] = Agents(tools, engine.tokenizer).generate(
        policy, [AgentRequest(problem, n=1, seed=0, request_id="p")], SamplingParams(max_tokens=64)
    )
    [sample] = result.samples
    record = sample.flags[AGENT_FLAGS]
    assert (record["end_reason"], record["turns"], record["tool_errors"]) == ("done", 2, 0)
    assert record["repaired_chars"] == 2
    assert "<tool_response>\n\ufffd and \ufffd\n\n</tool_response>" in observed_text(
        engine.tokenizer, sample
    )


@pytest.mark.parametrize("env_class", ["tests.envs.sample_envs:Garbled", sample_envs.Garbled])
def test_an_observation_the_tokenizer_cannot_encode_is_repaired_and_counted(engine, env_class):
    """Lone surrogates in an environment's prompt and observation become U+FFFD, one per code
    point, counted in the trajectory's record, whether the class is named or passed as an
    object; the NUL, which the tokenizer encodes and decodes as it is, stays."""
    garbled = settings(env_class=env_class, kwargs={})
    results = run(engine, garbled, n=1)
    for result in results:
        [sample] = result.samples
        record = sample.flags[AGENT_FLAGS]
        assert (record["end_reason"], record["turns"], record["env_reward"]) == ("done", 2, 1.0)
        assert record["repaired_chars"] == 1 + 3  # the prompt's one, the observation's three
        assert "lone \ufffd, nul \x00, bytes \ufffd\ufffd" in observed_text(
            engine.tokenizer, sample
        )
        assert engine.tokenizer.decode(result.prompt_ids).count("\ufffd") == 1
