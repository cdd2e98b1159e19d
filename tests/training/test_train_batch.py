"""TrainBatch layout: right padding, response/loss masks, micro-batch slicing and log-prob alignment."""

import pytest
import torch

from rlvr.training.batch import build_batch, token_logprobs


def test_build_batch_right_pads_and_masks_response_tokens():
    b = build_batch([[5, 6], [7]], [[8, 9, 10], [11]], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 8, 9, 10], [7, 11, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert b.response_mask.tolist() == [
        [False, False, True, True, True],
        [False, True, False, False, False],
    ]
    assert b.num_loss_tokens == 4
    assert b.advantages is None and b.old_logp is None


def test_loss_masks_drop_response_tokens():
    b = build_batch(
        [[5], [6]], [[7, 8, 9], [10]], pad_id=1, loss_masks=[[True, False, True], [False]]
    )
    assert b.input_ids.tolist() == [[5, 7, 8, 9], [6, 10, 1, 1]]
    assert b.response_mask.tolist() == [[False, True, False, True], [False, False, False, False]]
    with pytest.raises(ValueError, match="2 flags for 3"):
        build_batch([[5]], [[7, 8, 9]], pad_id=0, loss_masks=[[True, True]])


def test_bad_shapes_fail_loudly():
    with pytest.raises(ValueError, match="2 prompts but 1"):
        build_batch([[1], [2]], [[3]], pad_id=0)
    with pytest.raises(ValueError, match="at least one token"):
        build_batch([[]], [[3]], pad_id=0)
    with pytest.raises(ValueError, match="empty"):
        build_batch([], [], pad_id=0)


def test_micro_batch_cuts_shared_padding_and_slices_per_sequence_fields():
    b = build_batch([[5, 6], [7], [8]], [[9, 10, 11], [12], [13, 14]], pad_id=0)
    b.advantages = torch.tensor([1.0, 2.0, 3.0])
    b.old_logp = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    mb = b.micro_batch(1, 3)
    assert mb.input_ids.tolist() == [[7, 12, 0], [8, 13, 14]]
    assert mb.response_mask.tolist() == [[False, True, False], [False, True, True]]
    assert mb.advantages.tolist() == [2.0, 3.0]
    assert mb.old_logp.tolist() == [[5.0, 6.0, 7.0], [10.0, 11.0, 12.0]]
    assert mb.weights is None and len(mb) == 2


def test_token_logprobs_alignment():
    # logits[:, t] predicts input_ids[:, t + 1]; position 0 has no prediction and holds 0.
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]]))
    ids = torch.tensor([[2, 1, 2]])
    out = token_logprobs(logits, ids)
    expected = torch.log(torch.tensor([[1.0, 0.25, 0.8]]))
    assert torch.allclose(out, expected, atol=1e-6)
    assert out[0, 0] == 0.0


def test_a_forced_eos_is_marked_at_its_position():
    batch = build_batch([[1, 2], [3]], [[4, 5, 2], [6, 2]], pad_id=0, forced_eos=[2, None])
    assert batch.forced.tolist() == [
        [False, False, False, False, True],
        [False, False, False, False, False],
    ]
    with pytest.raises(ValueError, match="forced EOS"):
        build_batch([[1]], [[4, 2]], pad_id=0, forced_eos=[2])
