"""Block-wise FP8: the trainer's quantizer against transformers' own (a peer's implementation on the same tensors), the
engines' arithmetic, and which Hub tensors are FP8."""

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Quantize

from moerl import fp8
from moerl.models import family_for
from moerl.models.tiny import TINY_QWEN2, TINY_QWEN3


def test_quantize_matches_transformers_fine_grained_fp8():
    """transformers writes DeepSeek-V3-style checkpoints with the same blocks; it divides by 448/absmax where moerl
    divides by absmax/448, so a value on a rounding boundary may land one FP8 step apart."""
    torch.manual_seed(0)
    weight = torch.randn(256, 384) * torch.logspace(-3, 1, 384)  # blocks of very different ranges
    quantizer = SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=[128, 128], scale_fmt="float"))
    theirs = Fp8Quantize(quantizer)._quantize_one("w.weight", weight)
    q, scale = fp8.quantize(weight)
    assert scale.shape == theirs["w.weight_scale_inv"].shape == (2, 3)
    torch.testing.assert_close(scale, theirs["w.weight_scale_inv"], rtol=1e-6, atol=0)
    same = q.float() == theirs["w.weight"].float()
    assert same.float().mean() > 0.999
    # where they differ, by one FP8 step at most
    ours_deq, their_deq = fp8.dequantize(q, scale), fp8.dequantize(theirs["w.weight"], scale)
    step = (weight.abs() * 2**-3).clamp(min=scale.max() * 2**-9)
    assert ((ours_deq - their_deq).abs() <= step + 1e-12).all()


def test_dequantize_is_within_half_an_fp8_step_and_ragged_blocks_are_their_own():
    torch.manual_seed(1)
    weight = torch.randn(130, 260)
    weight[128:, :] *= 1000.0  # the last row block alone is large: its scale must not touch the others
    q, scale = fp8.quantize(weight)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert q.shape == weight.shape and scale.shape == (2, 3)
    for i, rows in enumerate((slice(0, 128), slice(128, 130))):
        for j, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 260))):
            block = weight[rows, cols]
            assert scale[i, j] == pytest.approx(block.abs().max().item() / 448.0, rel=1e-6)
    error = (fp8.dequantize(q, scale) - weight).abs()
    # e4m3 keeps 3 mantissa bits: a normal value is within 2^-4 of itself; subnormals within half of 2^-9 * scale
    bound = torch.maximum(
        weight.abs() * 2**-4, scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :260] * 2**-10
    )
    assert (error <= bound * 1.0001).all()


def test_a_zero_block_stays_zero():
    q, scale = fp8.quantize(torch.zeros(128, 128))
    assert (q.float() == 0).all() and torch.isfinite(scale).all()
    assert (fp8.dequantize(q, scale) == 0).all()


def test_activations_are_quantized_per_token_and_group():
    x = torch.ones(2, 256)
    x[0, 0] = 448.0  # the first group of the first token: ones become small against it
    y = fp8.quantize_activations(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y[1] == 1).all() and (y[0, 128:] == 1).all()  # other tokens and groups unaffected
    assert y[0, 0] == 448.0
    ragged = torch.randn(3, 5, 200)
    relative = (fp8.quantize_activations(ragged) - ragged).abs() / ragged.abs().amax(-1, keepdim=True)
    assert relative.max() < 2**-4


@pytest.mark.parametrize(
    "config",
    [TINY_QWEN3 | {"architectures": ["Qwen3MoeForCausalLM"]}, TINY_QWEN2 | {"architectures": ["Qwen2MoeForCausalLM"]}],
    ids=["qwen3_moe", "qwen2_moe"],
)
def test_the_linear_projections_of_the_layers_are_fp8_and_nothing_else(config):
    family = family_for(config)
    shapes = family.hub_shapes(family.normalize(config))
    quantized = {name for name in shapes if fp8.is_quantized(name)}
    kept = set(shapes) - quantized
    assert all(name.startswith("model.layers.") and name.endswith("_proj.weight") for name in quantized)
    assert any(".mlp.experts.0.down_proj." in name for name in quantized)
    assert any(name.endswith("self_attn.q_proj.weight") for name in quantized)
    # SGLang keeps these in the model dtype: the router, Qwen2-MoE's shared-expert gate, norms, embeddings, lm_head
    assert any(name.endswith("mlp.gate.weight") for name in kept)
    assert all(not name.endswith("_proj.weight") or not name.startswith("model.layers.") for name in kept)
    if "shared_expert_intermediate_size" in config:
        assert any(name.endswith("shared_expert_gate.weight") for name in kept)
        assert any(".shared_expert.up_proj." in name for name in quantized)
    named = [(name, torch.randn(shape)) for name, shape in shapes.items()]
    out = dict(fp8.quantize_named(named))
    assert set(out) == set(shapes) | {fp8.scale_name(name) for name in quantized}
    for name in quantized:
        assert out[name].dtype == torch.float8_e4m3fn
        assert out[fp8.scale_name(name)].shape == fp8.scale_shape(shapes[name])
    # what an FP8 replica holds: a byte per quantized element, 4 per block scale, the model dtype for the rest
    assert fp8.hub_bytes(shapes, 2) == sum(
        t.numel() * t.element_size() for t in out.values() if t.dtype != torch.float32
    ) + sum(
        t.numel() * (4 if name.endswith(fp8.SCALE_SUFFIX) else 2) for name, t in out.items() if t.dtype == torch.float32
    )


def test_tensor_parallel_shares_must_be_whole_blocks():
    shapes = {
        "model.layers.0.mlp.experts.0.down_proj.weight": (2048, 768),  # Qwen3-30B-A3B's expert
        "model.layers.0.mlp.experts.0.up_proj.weight": (768, 2048),
    }
    assert fp8.check_shards(shapes, 1) is None
    assert fp8.check_shards(shapes, 2) is None  # 384 = 3 blocks a rank
    problem = fp8.check_shards(shapes, 4)  # 192: a block and a half
    assert problem is not None and "down_proj" in problem and "128" in problem


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_quantizes_to_the_same_bytes_as_the_cpu():
    """The engines start from an FP8 copy made on the CPU, and the trainer quantizes its pushes on its GPU: one weight
    must give one FP8 tensor and one scale, bit for bit, or unchanged blocks differ between a delta and a full push."""
    torch.manual_seed(0)
    weight = torch.randn(384, 640) * torch.logspace(-3, 1, 640)
    q, scale = fp8.quantize(weight)
    q_gpu, scale_gpu = fp8.quantize(weight.cuda())
    assert torch.equal(scale_gpu.cpu(), scale)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q.view(torch.uint8))
    x = torch.randn(5, 300)
    assert torch.equal(fp8.quantize_activations(x.cuda()).cpu(), fp8.quantize_activations(x))
