"""SegmentAttention: a packed row's segment table as megatron-core's dense mask on the CPU, as FlexAttention's block
mask on a GPU; both equal to each sample's own causal attention."""

from __future__ import annotations

import pytest
import torch

from moerl.megatron.launch import run_ranks
from tests.workers import segment_attention_against_references


@pytest.mark.e2e  # a rank process (see pytest.ini)
def test_a_segment_table_attends_as_each_sample_alone_and_the_kernel_agrees_on_the_cpu():
    (result,) = run_ranks(segment_attention_against_references, 1, "float32", use_cuda=False)
    assert result["device"] == "cpu" and not result["flex_used"]
    assert result["flex_vs_dense"] == 0.0  # the CPU path is the dense mask itself
    assert result["dense_vs_own"] < 1e-6
    assert result["kernel_vs_dense"] < 1e-5  # FlexAttention's eager forward, under the block mask the GPU path builds


@pytest.mark.e2e
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_flex_attention_on_a_gpu_equals_the_dense_mask_forward_and_backward(dtype, tolerance):
    (result,) = run_ranks(segment_attention_against_references, 1, dtype, use_cuda=True)
    assert result["device"] == "cuda" and result["flex_used"]
    assert result["flex_vs_dense"] < tolerance and result["dense_vs_own"] < tolerance
    assert result["grads"] < tolerance, result


def test_a_kernel_whose_rows_differ_from_the_reference_is_refused_before_its_output_is_used():
    from torch.nn.attention.flex_attention import flex_attention

    from moerl.megatron.segments import KernelMismatch, block_mask, check_rows, flex_width, segment_table

    segments = torch.repeat_interleave(torch.arange(3), torch.tensor([40, 30, 30]))
    table = segment_table(segments, torch.tensor([2, 2, 3])[segments])  # the second follows the first
    width = flex_width(100)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, width, 16, generator=gen) for n in (4, 2, 2))
    with torch.no_grad():
        out = flex_attention(q, k, v, block_mask=block_mask(table), scale=0.25, enable_gqa=True)
    check_rows(out, q, k, v, table, 0.25)  # the kernel's own output passes
    with pytest.raises(KernelMismatch, match=r"trainer.micro_batch_format=padded"):
        check_rows(out, q, k, v, table, 0.5)  # as a kernel that scaled the scores wrongly
    wrong = out.clone()
    wrong[0, :, 50] = out[0, :, 60]  # one row attending as another
    with pytest.raises(KernelMismatch):
        check_rows(wrong, q, k, v, table, 0.25)
