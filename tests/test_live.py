"""Live learning's pure parts: EI rounds from the stream host (closed rounds, kept answers, rule
R2), the updater's durable state, its SFT mini-batches, and the adapter merge replicas switch to."""

from __future__ import annotations

import json

import pytest

from rlvr.config import ConfigError
from rlvr.models.checkpoints import merged_lora_weights
from rlvr.serving.config import load_serve_config
from rlvr.serving.live_updates import (
    UpdaterState,
    adapter_version,
    round_seqs,
    shuffled_batches,
)
from rlvr.serving.stream_host import CSAStreamHost, PredictabilityError, StreamSpec

SPEC = StreamSpec(alpha=0.5, delta=0.1, grid=(0.05, 0.1, 0.3))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def experience(seq: int) -> dict:
    """A kept round; the even ones were shadow-verified against a reference."""
    reference = str(seq) if seq % 2 == 0 else None
    return {"prompt_ids": [1, 2, seq], "response_ids": [seq, 9], "reference": reference}


def test_a_round_closes_only_when_every_seq_is_applied_and_yields_its_passed_answers(tmp_path):
    host = CSAStreamHost(tmp_path, clock=Clock())
    host.open_stream("s", SPEC, policy="base", scorer="g")
    host.open_stream("other", SPEC, policy="base", scorer="g")
    for seq in range(4):
        assert host.decide("s", 0.1, policy="base", experience=experience(seq))["seq"] == seq
    host.decide("s", 0.1, policy="base")  # seq 4: decided without a kept answer
    assert host.closed_round("s", 0, 4) is None
    host.observe("s", 1, True)
    host.observe("s", 2, False)
    host.observe("s", 3, True)
    assert host.closed_round("s", 0, 4) is None  # seq 0 holds the queue
    host.observe("s", 0, True)
    closed = host.closed_round("s", 0, 4)
    assert closed["labels"] == {0: "pass", 1: "pass", 2: "fail", 3: "pass"}
    assert [p["seq"] for p in closed["pairs"]] == [0, 1, 3]
    assert closed["pairs"][2] == {"seq": 3, "policy": "base", **experience(3)}
    assert closed["passed_without_experience"] == []
    # GRPO's prompts: every kept round with a reference, whatever its label.
    assert [e["seq"] for e in closed["references"]] == [0, 2]
    host.observe("s", 4, True)
    assert host.closed_round("s", 4, 5)["passed_without_experience"] == [4]
    with pytest.raises(ValueError, match="empty"):
        host.closed_round("s", 3, 3)
    # Each applied round's audit line names the policy its replica served it with.
    audit = [json.loads(line) for line in host.audit_path("s").read_text().splitlines()]
    assert {line["served_policy"] for line in audit} == {"base"}


def test_published_versions_serve_only_later_seqs_and_publishing_is_idempotent(tmp_path):
    clock = Clock()
    host = CSAStreamHost(tmp_path, clock=clock)
    host.open_stream("s", SPEC, policy="base", scorer="g")
    host.open_stream("other", SPEC, policy="base", scorer="g")
    for seq in range(3):
        host.decide("s", 0.1, policy="base", experience=experience(seq))
    host.observe("s", 0, True)
    host.observe("s", 1, True)
    with pytest.raises(ValueError, match="not all applied"):
        host.publish("live-0@a", trained_through=2, source="s")
    assert host.publish("live-0@a", trained_through=1, source="s") == {"other": 0, "s": 3}
    assert host.publish("live-0@a", trained_through=1, source="s") == {"other": 0, "s": 3}
    assert host.versions("s") == {"policy": "live-0@a", "scorer": "g"}
    history = host.status("s")["version_history"]
    assert history[-1] == {"seq": 3, "policy": "live-0@a", "scorer": "g", "trained_through": 1}
    assert "trained_through" not in host.status("other")["version_history"][-1]
    # The switch is an event in each stream's audit trail (published once: the repeat is a no-op).
    events = [
        json.loads(line)
        for line in host.audit_path("s").read_text().splitlines()
        if '"event"' in line
    ]
    assert events == [
        {
            "event": "version",
            "at_seq": 3,
            "policy": "live-0@a",
            "scorer": "g",
            "trained_through": 1,
            "time": 1000.0,
        }
    ]
    # R2: a policy trained through seq 1 may serve seq 3; a replica still on the old one may too.
    assert host.decide("s", 0.1, policy="live-0@a")["served_policy"] == "live-0@a"
    assert host.decide("s", 0.1, policy="base")["seq"] == 4
    # A version trained past the next seq would leak labels into its own round: refused.
    host.observe("s", 2, True)
    for seq in (3, 4):
        host.observe("s", seq, True)
    host.publish("live-1@b", trained_through=4, source="s")
    host.close()
    restored = CSAStreamHost(tmp_path, clock=clock)
    restored.switch_versions("s", policy="sneaky", trained_through=4)
    restored._streams["s"].ctrl._versions[-1]["trained_through"] = 9  # as if trained on the future
    with pytest.raises(PredictabilityError, match="rule R2"):
        restored.decide("s", 0.1, policy="sneaky")
    assert restored.status("s")["next_seq"] == 5  # nothing was issued


def test_the_serving_policy_of_an_open_round_survives_a_restart(tmp_path):
    clock = Clock()
    host = CSAStreamHost(tmp_path, clock=clock)
    host.open_stream("s", SPEC, policy="base", scorer="g")
    host.decide("s", 0.1, policy="base")
    host.observe("s", 0, True)  # snapshot: no open round
    host.decide("s", 0.2, policy="live-0@a")  # only in the journal
    host.close()
    restored = CSAStreamHost(tmp_path, clock=clock)
    assert restored.state("s")["rounds"] == [[1, 1000.0, None, "feedback", "live-0@a"]]
    restored.observe("s", 1, False)
    audit = [json.loads(line) for line in restored.audit_path("s").read_text().splitlines()]
    assert [line["served_policy"] for line in audit] == ["base", "live-0@a"]


def test_updater_state_round_trips_and_starts_fresh(tmp_path):
    path = tmp_path / "updater.json"
    assert UpdaterState.load(path) == UpdaterState()
    assert UpdaterState().latest is None
    state = UpdaterState(next_round=3, published=[{"round": 0}, {"round": 2}], skipped=[1])
    state.save(path)
    assert UpdaterState.load(path) == state and state.latest == {"round": 2}
    assert round_seqs(0, 100) == (0, 100) and round_seqs(3, 8) == (24, 32)


def test_shuffled_batches_take_every_pair_once_per_epoch():
    steps = shuffled_batches(10, 4, epochs=2, seed=7)
    # ceil(10 / 4) = 3 steps per epoch, as even as possible.
    assert [len(s) for s in steps] == [3, 4, 3, 3, 4, 3]
    for epoch in (steps[:3], steps[3:]):
        assert sorted(i for s in epoch for i in s) == list(range(10))
    assert steps[:3] != steps[3:]  # each epoch its own order
    assert shuffled_batches(10, 4, epochs=2, seed=7) == steps
    assert shuffled_batches(1, 4, epochs=1, seed=0) == [[0]]
    with pytest.raises(ValueError):
        shuffled_batches(0, 4, epochs=1, seed=0)


@pytest.fixture(scope="module")
def tiny_lora(tmp_path_factory):
    """The tiny model and a LoRA adapter on it whose B starts away from 0 (it changes outputs)."""
    import peft
    from transformers import AutoModelForCausalLM

    from rlvr.models import resolve_model_path

    base = resolve_model_path("tiny")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    adapted = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    out = tmp_path_factory.mktemp("lora") / "adapter"
    adapted.save_pretrained(out)
    return base, out, adapted


def test_the_merged_adapter_equals_peft_merge_and_unload(tiny_lora):
    import torch
    from safetensors import safe_open

    base, adapter, adapted = tiny_lora
    merged = dict(merged_lora_weights(base, adapter))
    want = adapted.merge_and_unload().state_dict()
    with safe_open(next(base.glob("*.safetensors")), framework="pt") as f:
        assert set(merged) == set(f.keys())
    changed = 0
    for name, tensor in merged.items():
        # peft adds B @ A * s in fp32; here it is summed in fp64 and rounded once: <= 1 ulp apart.
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=1e-6)
        changed += not torch.equal(tensor, base_tensor(base, name))
    assert changed == 2 * adapted.config.num_hidden_layers  # q and v of every layer


def base_tensor(base, name):
    from safetensors import safe_open

    with safe_open(next(base.glob("*.safetensors")), framework="pt") as f:
        return f.get_tensor(name)


def test_adapter_version_names_the_content(tiny_lora, tmp_path):
    import shutil

    _, adapter, _ = tiny_lora
    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy)
    version = adapter_version(2, adapter)
    assert version.startswith("live-2@") and adapter_version(2, copy) == version
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 16}))
    assert adapter_version(2, copy) != version
    # An adapter for layers the base model lacks is refused before any weight is handed out.
    from safetensors.torch import load_file, save_file

    tensors = load_file(copy / "adapter_model.safetensors")
    key = next(iter(tensors))
    tensors[key.replace("layers.0.", "layers.99.")] = tensors.pop(key)
    save_file(tensors, copy / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="layers.99"):
        next(merged_lora_weights(tiny_lora[0], copy))


def test_live_config_names_the_bad_key():
    cfg = load_serve_config(None, ["live.enabled=true"])
    assert cfg.live_stream() == "default" and cfg.live.lora.r == 16
    assert cfg.live_dir().as_posix() == "runs/serve/live"
    with pytest.raises(ConfigError, match="live.stream"):
        load_serve_config(None, ["live.stream=nope"])
    with pytest.raises(ConfigError, match="lora.enabled"):
        load_serve_config(None, ["live.enabled=true", "live.lora.enabled=false"])
    with pytest.raises(ConfigError, match="live.round_size"):
        load_serve_config(None, ["live.round_size=0"])
    assert load_serve_config(None, ["live.algorithm=grpo"]).live.group_size == 8
    with pytest.raises(ConfigError, match="live.algorithm"):
        load_serve_config(None, ["live.algorithm=ppo"])
    with pytest.raises(ConfigError, match="live.group_size"):
        load_serve_config(None, ["live.group_size=1"])


def test_unit_advantages_on_policy_are_the_sft_gradient():
    """The updater's SFT step is `train_step` with advantages 1 and pi_old = the policy itself:
    the clipped surrogate's gradient at ratio 1 is that of the token-mean NLL (to rounding)."""
    import torch

    from rlvr.algorithms.grpo import policy_loss

    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 6))
    mask = torch.rand(3, 6) > 0.3
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    loss, _ = policy_loss(logp, logp.detach(), torch.ones(3), mask, agg="token-mean")
    (surrogate,) = torch.autograd.grad(loss, logits, retain_graph=True)
    nll = -(logp * mask).sum() / mask.sum()
    (sft,) = torch.autograd.grad(nll, logits)
    torch.testing.assert_close(surrogate, sft, rtol=0, atol=1e-7)
