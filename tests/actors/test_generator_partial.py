"""A GeneratorActor between `begin_partial` and `end_partial` (in one process, the board a plain
`VersionBoard`): it loads the newer version from the board mid-call, for single-turn samples and
multi-turn agents alike (their turns' versions joined into one record), ends every engine on the
second version with one weight-version step, and a board closed while it waits ends the call."""

import threading

import pytest
import torch

from actors.generator import GeneratorActor
from actors.versions import BoardClosed, VersionBoard
from rlvr.envs.rollout import AgentRequest, EnvSettings
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.generation.segments import POLICY_VERSIONS
from rlvr.tasks import Problem

PARAMS = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
BOUNDARY = 4


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return GeneratorActor("hf", str(tiny_model_dir), threads=1, dtype="float32")


@pytest.fixture
def board(engine):
    """Versions 3 and 4 posted: the engine's own weights, then a perturbation of them."""
    original = {n: p.detach().clone() for n, p in engine.backend.model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    newer = {n: p + 0.5 * torch.randn(p.shape, generator=generator) for n, p in original.items()}
    board = VersionBoard()
    board.post(3, [original])
    board.post(4, [newer])
    yield board
    engine.backend.load_weights(original.items())


def test_single_turn_samples_switch_version_at_the_boundary(engine, board):
    version = engine.weight_version
    engine.begin_partial(BOUNDARY, (3, 4), board)
    results = engine.generate(
        [GenerationRequest([5, 6, 7], n=4, seed=1)], PARAMS, weight_version=version
    )
    for sample in results[0].samples:
        n = len(sample.token_ids)
        expected = [[3, n]] if n <= BOUNDARY else [[3, BOUNDARY], [4, n - BOUNDARY]]
        assert sample.flags[POLICY_VERSIONS] == expected
    with pytest.raises(ValueError, match="tandem generation"):
        engine.generate([GenerationRequest([5])], PARAMS, tandem=True)
    end = engine.end_partial()
    assert end["version"] == engine.weight_version == version + 1
    assert end["wait_s"] > 0  # the newer version was loaded mid-call


def test_agents_record_the_versions_of_their_model_tokens(engine, board):
    env = EnvSettings(
        kind="python",
        env_class="tests.envs.sample_envs:GuessTheAnswer",
        kwargs={"tries": 3},
        max_turns=4,
    )
    requests = [AgentRequest(Problem("p", "Compute 2 + 2.", "4"), n=2, seed=5)]
    engine.begin_partial(BOUNDARY, (3, 4), board)
    results = engine.generate_agents(requests, PARAMS, env)
    engine.end_partial()
    for result in results:
        [sample] = result.samples
        model_tokens = sum(sample.model_tokens)
        assert model_tokens > BOUNDARY  # three turns of the tiny model
        assert sample.flags[POLICY_VERSIONS] == [[3, BOUNDARY], [4, model_tokens - BOUNDARY]]


def test_an_engine_whose_samples_never_paused_still_ends_on_the_second_version(engine, board):
    version = engine.weight_version
    engine.begin_partial(100, (3, 4), board)
    engine.generate([GenerationRequest([5, 6, 7], n=2, seed=1)], PARAMS)
    assert engine.end_partial()["version"] == version + 1
    newer = board.snapshot(4)[0]
    name = "model.embed_tokens.weight"
    assert torch.equal(dict(engine.backend.model.named_parameters())[name], newer[name])


def test_a_board_closed_while_the_engine_waits_ends_the_call(engine):
    board = VersionBoard()
    board.post(3, [{n: p.detach().clone() for n, p in engine.backend.model.named_parameters()}])
    engine.begin_partial(BOUNDARY, (3, 4), board)  # version 4 is never posted
    threading.Timer(0.5, board.close).start()
    with pytest.raises(BoardClosed, match="policy version 4"):
        engine.generate([GenerationRequest([5, 6, 7], n=2, seed=1)], PARAMS)
    with pytest.raises(BoardClosed):
        engine.end_partial()
    # partial rollouts ended: the engine samples as before, with the weights it holds
    [result] = engine.generate([GenerationRequest([5, 6, 7], n=1, seed=1)], PARAMS)
    assert POLICY_VERSIONS not in result.samples[0].flags
