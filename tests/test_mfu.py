"""Model FLOPs per phase against hand counts (the tiny model and SmolLM2-135M), against the real
models' projection weights, and the peak: datasheet lookup on CUDA names, a measured GEMM cached."""

import json

import pytest
import torch

from rlvr.run.mfu import (
    TransformerShape,
    datasheet_peak,
    mfu,
    peak_flops,
    phase_flops,
    step_utilisation,
)

TINY_CONFIG = {  # the tiny model's config.json (rlvr.models.tiny, qwen2), trimmed to what counts
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "tie_word_embeddings": True,
}
# per layer: q, o 256x256 (65536 each), k, v 256x128 (32768 each), MLP 3 x 256x512 (393216);
# 2 layers x 589824 + LM head 1024x256 (262144)
TINY_N = 2 * (2 * 65536 + 2 * 32768 + 393216) + 262144
# per layer: q, o 576x576, k, v 576x192, MLP 3 x 576x1536; 30 layers + LM head 49152x576
SMOLLM2_N = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 49152 * 576


@pytest.fixture(scope="module")
def smollm2_config():
    """SmolLM2-135M-Instruct's config, read from the bundled GGUF's metadata (no weights)."""
    from transformers import AutoConfig

    from rlvr.models.smollm2 import smollm2_gguf

    gguf = smollm2_gguf()
    return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)


def test_tiny_matmul_params_by_hand():
    shape = TransformerShape.from_hf_config(TINY_CONFIG)
    assert (shape.layers, shape.attention_width, shape.kv_heads) == (2, 256, 2)
    assert shape.matmul_params == TINY_N == 1_441_792


def test_smollm2_matmul_params_by_hand(smollm2_config):
    shape = TransformerShape.from_hf_config(smollm2_config)
    assert shape == TransformerShape(30, 576, 9, 3, 64, 1536, 49152)
    assert shape.matmul_params == SMOLLM2_N == 134_479_872


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_matmul_params_are_the_real_models_projection_weights(which, smollm2_config):
    """N is every nn.Linear weight of the instantiated model (LM head once, tied or not), and the
    model's whole parameter count is N + embedding + norms (+ Qwen2's q/k/v biases)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**TINY_CONFIG) if which == "tiny" else smollm2_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert TransformerShape.from_hf_config(config).matmul_params == linear
    if which == "smollm2":  # 134.5M: the model's published size; tied head counted once
        norms = 30 * 2 * 576 + 576
        assert sum(p.numel() for p in model.parameters()) == SMOLLM2_N + norms == 134_515_008


def test_train_and_forward_flops_by_hand():
    shape = TransformerShape.from_hf_config(TINY_CONFIG)
    # one sequence of T = 10 + 6 = 16 tokens; L H Q = 2 x 4 x 64 = 512
    train = 6 * TINY_N * 16 + 12 * 512 * 16 * 16
    assert phase_flops("train", shape, [10], [6]) == train == 139_984_896
    assert phase_flops("forward", shape, [10], [6]) == train / 3
    # sequences add up
    two = phase_flops("train", shape, [10, 3], [6, 1])
    assert two == train + 6 * TINY_N * 4 + 12 * 512 * 4 * 4


def test_generate_flops_count_the_real_context_by_hand():
    shape = TransformerShape.from_hf_config(TINY_CONFIG)
    # P = 10, R = 6: positions 0..14 run through the model (the 6th token is never fed back),
    # position i attends i + 1 keys: 1 + 2 + ... + 15 = 120
    assert phase_flops("generate", shape, [10], [6]) == 2 * TINY_N * 15 + 4 * 512 * 120
    assert phase_flops("generate", shape, [0], [0]) == 0.0


def test_smollm2_train_flops_per_token(smollm2_config):
    """The familiar 6N: at T = 512, 6 x 134.48M + 12 x 30 x 576 x 512 = 913.0M FLOPs per token."""
    shape = TransformerShape.from_hf_config(smollm2_config)
    per_token = phase_flops("train", shape, [256], [256]) / 512
    assert per_token == 6 * SMOLLM2_N + 12 * 30 * 576 * 512 == 913_047_552


def test_mfu_is_flops_per_second_over_peak():
    shape = TransformerShape.from_hf_config(TINY_CONFIG)
    flops = phase_flops("train", shape, [10], [6])
    assert mfu("train", shape, [10], [6], seconds=2.0, peak_flops=flops) == 0.5


def test_a_step_s_utilisation_per_phase():
    """Training counts each pass over the batch (training.epochs); a phase that took no time is
    left out; without a peak (GPU runs) only the FLOP/s are logged."""
    shape = TransformerShape.from_hf_config(TINY_CONFIG)
    train, generate = (
        phase_flops("train", shape, [10], [6]),
        phase_flops("generate", shape, [10], [6]),
    )
    seconds = {"time_train": 4.0, "time_generate": 2.0}
    got = step_utilisation(shape, [10], [6], seconds, train_passes=2, peak=train)
    assert got == {
        "flops_per_s_generate": generate / 2.0,
        "mfu_generate": generate / 2.0 / train,
        "flops_per_s_train": 2 * train / 4.0,
        "mfu_train": 0.5,
    }
    assert step_utilisation(shape, [10], [6], {"time_train": 0.0}, 1, None) == {}
    assert step_utilisation(shape, [10], [6], seconds, 1, None).keys() == {
        "flops_per_s_generate",
        "flops_per_s_train",
    }


@pytest.mark.parametrize(
    "bad",
    [
        lambda s: phase_flops("rollout", s, [1], [1]),
        lambda s: phase_flops("train", s, [1, 2], [1]),
        lambda s: phase_flops("train", s, [-1], [1]),
        lambda s: mfu("train", s, [1], [1], seconds=0.0, peak_flops=1.0),
    ],
)
def test_bad_input_is_refused(bad):
    with pytest.raises(ValueError):
        bad(TransformerShape.from_hf_config(TINY_CONFIG))


def test_unknown_architecture_is_refused_not_miscounted():
    with pytest.raises(ValueError, match="gpt2"):
        TransformerShape.from_hf_config({**TINY_CONFIG, "model_type": "gpt2"})


@pytest.mark.parametrize(
    "name, flops",
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H20", 148e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_datasheet_peaks(name, flops):
    assert datasheet_peak(name) == flops


def test_cpu_peak_is_measured_once_and_cached(tmp_path):
    first = peak_flops("float32", cache=tmp_path)
    (entry,) = tmp_path.glob("peak-*.json")
    stored = json.loads(entry.read_text())
    assert stored["key"]["threads"] == torch.get_num_threads()
    assert stored["key"]["torch"] == torch.__version__ and stored["key"]["dtype"] == "float32"
    assert first == stored["flops"] > 0
    entry.write_text(json.dumps({**stored, "flops": 123.0}))  # the second call must read it
    assert peak_flops("float32", cache=tmp_path) == 123.0
    with pytest.raises(ValueError):
        peak_flops("float16", cache=tmp_path)
