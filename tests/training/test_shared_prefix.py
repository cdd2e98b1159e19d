"""Shared-prefix packing: the packed layout by hand, and the packed forward giving the plain
forward's log-probs, losses and gradients (full fine-tuning and LoRA, ZeRO 0-3, every loss
aggregation, DUET weights, Tandem-style loss masks)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlvr.models.tiny import build_tiny_model
from rlvr.training import policy_trainer
from rlvr.training.batch import TrainBatch, build_batch, token_entropy, token_logprobs
from rlvr.training.lm_head import loss_token_stats
from rlvr.training.policy_trainer import PolicyTrainer
from rlvr.training.settings import LoraSettings
from rlvr.training.shared_prefix import pack_shared_prefixes, packed_length, prompt_groups

# Two groups of one prompt each (three and two responses of different lengths) and a lone row.
PROMPTS = [[3, 4, 5]] * 3 + [[6, 7, 8, 9]] * 2 + [[3, 4]]
RESPONSES = [[11, 12, 13], [14], [15, 16, 17, 18, 19], [20, 21], [22, 23, 24], [25, 26]]
# Tandem-style gaps (a junior's tokens carry no loss) and a row without any loss token.
LOSS_MASKS = [[1, 0, 1], [1], [1, 1, 0, 0, 1], [0, 0], [1, 1, 1], [0, 1]]
ADVANTAGES = [1.0, -1.0, 0.5, 2.0, -0.5, 1.5]
WEIGHTS = [1.0, 2.0, 0.5, 1.0, 1.5, 1.0]  # DUET's per-rollout weights


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def make_batch() -> TrainBatch:
    batch = build_batch(
        PROMPTS, RESPONSES, pad_id=0, loss_masks=[[bool(f) for f in m] for m in LOSS_MASKS]
    )
    batch.advantages = torch.tensor(ADVANTAGES)
    batch.weights = torch.tensor(WEIGHTS)
    return batch


def test_groups_and_packed_layout_by_hand():
    batch = build_batch([[3, 4, 5], [6, 7], [3, 4, 5]], [[11, 12], [13], [14, 15, 16]], pad_id=0)
    assert prompt_groups(batch) == [[0, 2], [1]]
    assert packed_length(batch, [0, 2]) == 3 + 2 + 3
    packed = pack_shared_prefixes(batch, torch.float32)
    assert packed.input_ids.tolist() == [[3, 4, 5, 11, 12, 14, 15, 16], [6, 7, 13, 0, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 2, 0, 0, 0, 0, 0]]
    allowed = (packed.attention_mask[:, 0] == 0).int()
    assert allowed[0].tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],  # the first response sees the prompt and itself
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 0, 0],  # the second sees the prompt, not the first response
        [1, 1, 1, 0, 0, 1, 1, 0],
        [1, 1, 1, 0, 0, 1, 1, 1],
    ]
    assert allowed[1, :3, :3].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert allowed[1, 3:].tolist() == torch.eye(8, dtype=torch.int)[3:].tolist()  # padding
    # loss tokens in response_mask.nonzero() order: (0,3) (0,4) (1,2) (2,3) (2,4) (2,5); a
    # response's first token is predicted from its prompt's last position, shared by the group
    assert packed.predicting[0].tolist() == [0, 0, 1, 0, 0, 0]
    assert packed.predicting[1].tolist() == [2, 3, 1, 2, 5, 6]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_forward_gives_the_plain_logprobs_and_entropies(model_dir, attention):
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention).eval()
    batch = make_batch()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp, entropy, *_ = loss_token_stats(model, batch, 0.7, 4, shared_prefix=True)
    mask = batch.response_mask
    assert int(mask.sum()) == 10
    # fp32 attention over a longer, masked key axis: equal up to summation order
    torch.testing.assert_close(logp[mask], token_logprobs(logits, batch.input_ids, 0.7)[mask])
    torch.testing.assert_close(entropy[mask], token_entropy(logits, 0.7)[mask])
    assert not logp[~mask].any() and not entropy[~mask].any()


@pytest.mark.parametrize(
    ("stage", "lora", "agg"),
    [
        (0, False, "token-mean"),
        (1, False, "seq-mean-token-mean"),
        (2, False, "seq-mean-token-sum-norm"),
        (2, True, "token-mean"),
        (3, False, "token-mean"),
        (3, True, "seq-mean-token-mean"),
    ],
)
def test_packed_train_step_equals_the_plain_one(model_dir, step_with_grads, stage, lora, agg):
    """Same loss, KL, entropy and gradients, micro-batched by rows and by token budget, with and
    without activation checkpointing."""
    common = {
        "zero_stage": stage,
        "lora": LoraSettings(r=4, alpha=8) if lora else None,
        "lr": 5e-3,
        "seed": 0,
        "kl_coef": 0.1,
        "loss_agg": agg,
        "grad_clip": 1e6,
        "temperature": 0.7,
    }
    settings = [
        {"micro_batch_size": 3},
        {"micro_batch_size": 3, "shared_prefix": True},
        {"micro_batch_tokens": 16, "shared_prefix": True},
        {"micro_batch_tokens": 16, "shared_prefix": True, "gradient_checkpointing": True},
    ]

    def run(settings: dict) -> tuple[dict, dict[str, torch.Tensor]]:
        trainer = PolicyTrainer(model_dir, **common, **settings)
        batch = make_batch()
        batch.ref_logp = trainer.ref_logprobs(batch)
        return step_with_grads(trainer, batch)

    runs = [run(kw) for kw in settings]
    (m0, g0) = runs[0]
    for metrics, grads in runs[1:]:
        for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
            assert metrics[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), key
        assert grads.keys() == g0.keys()
        for name in g0:
            torch.testing.assert_close(grads[name], g0[name], rtol=1e-4, atol=1e-6)


def saved_activation_bytes(trainer: PolicyTrainer) -> int:
    """Bytes autograd keeps for backward during one train step, outside checkpointed regions
    (a checkpoint's own saved-tensor hooks take the tensors it recomputes)."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step(make_batch())
    return saved


def test_gradient_checkpointing_keeps_a_fraction_of_the_activations(model_dir):
    kept = [
        saved_activation_bytes(
            PolicyTrainer(model_dir, micro_batch_size=8, gradient_checkpointing=checkpointing)
        )
        for checkpointing in (False, True)
    ]
    # the tiny model's two layers keep their inputs only; the head and embeddings stay as they are
    assert kept[1] < 0.5 * kept[0]


def test_token_budget_micro_batches_keep_prompt_groups_together(model_dir):
    trainer = PolicyTrainer(model_dir, micro_batch_tokens=16, shared_prefix=True)
    parts = trainer._micro_batches(make_batch())
    # packed lengths 3 + 3 + 1 + 5 = 12, 4 + 2 + 3 = 9 and 2 + 2 = 4: no two fit in 16 as packs
    # padded to the longer one
    assert parts == [[0, 1, 2], [3, 4], [5]]


def test_attention_without_block_masks_falls_back_and_says_so(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(policy_trainer, "BLOCK_MASK_ATTENTION", ("flash_attention_2",))
    with caplog.at_level("WARNING", logger=policy_trainer.__name__):
        trainer = PolicyTrainer(model_dir, shared_prefix=True)
    assert trainer.shared_prefix is False
    assert "training.shared_prefix is off" in caplog.text


def test_a_sliding_window_shorter_than_a_pack_runs_the_plain_forward(model_dir, tmp_path, caplog):
    """Packed, a response sits further from the prompt than in its own row, so a sliding window
    would cut its context elsewhere: batches whose packs exceed the window run the plain
    forward (and say so once), batches whose packs fit it still pack."""
    from transformers import AutoConfig

    windowed = tmp_path / "windowed"
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(windowed)
    config = AutoConfig.from_pretrained(model_dir)
    config.use_sliding_window, config.sliding_window = True, 6
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    config.save_pretrained(windowed)
    batch = make_batch()  # packs of 12 and 9 tokens, rows of up to 8
    model = AutoModelForCausalLM.from_pretrained(windowed).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        packed, *_ = loss_token_stats(model, batch, 1.0, 4, shared_prefix=True)
    plain = token_logprobs(logits, batch.input_ids)
    mask = batch.response_mask
    assert (packed - plain)[mask].abs().max() > 1e-3  # what packing would have trained on

    with caplog.at_level("WARNING", logger=policy_trainer.__name__):
        trainer = PolicyTrainer(windowed, micro_batch_size=8, shared_prefix=True)
        logp = trainer.logprobs(batch)
    assert "6-token sliding window (12 here)" in caplog.text
    torch.testing.assert_close(logp[mask], plain[mask])
    fits = build_batch([[3, 4]] * 2, [[5, 6], [7]], pad_id=0)  # one pack of 2 + 2 + 1 tokens
    assert trainer._packs(fits)
