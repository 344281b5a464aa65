"""Attention over a packed row of segments, for megatron-core's local layers.

A packed micro-batch is one row of segments end to end: samples, or the prefix tree of what a group's samples share
(:func:`~moerl.trainer.batch.prefix_tree`). A position attends causally within its own segment and to its segment's
ancestors. The row's structure travels to every layer's core attention as :class:`PackedSegments`, megatron-core's
packed-sequence parameters carrying a *segment table* (:func:`~moerl.megatron.segments.segment_table`: per position
its segment's index and its subtree's end; the rule is :func:`~moerl.megatron.segments.sees`). Nothing ``s x s`` is
built for it on a GPU: FlexAttention's block-sparse kernel computes only the blocks the table makes visible. Without
CUDA (where FlexAttention has no backward) megatron-core's own attention takes the explicit mask the table gives.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from moerl.megatron.segments import block_mask, check_once, compiled, dense_mask, flex_width


class PackedSegments(PackedSeqParams):
    """megatron-core's packed-sequence parameters for one packed row of segments (queries, keys and values in its
    ``sbhd`` layout): ``table``, the row's segment table (see the module), on the row's device. megatron-core hands
    them unchanged to every layer's core attention, recompute included, and reads only the row's length of them
    (``max_seqlen_q``: RoPE's table); its own attention refuses them, :class:`SegmentAttention` takes them. Each mask
    of the table is built by the first layer that asks for it, for every layer of the forward."""

    def __init__(self, table: torch.Tensor):
        length = table.shape[1]
        super().__init__(qkv_format="sbhd", max_seqlen_q=length, max_seqlen_kv=length)
        self.table = table

    @functools.cached_property
    def dense_mask(self) -> torch.Tensor:
        """megatron-core's ``[1, 1, s, s]`` mask of the table (:func:`~moerl.megatron.segments.dense_mask`)."""
        return dense_mask(self.table)

    @functools.cached_property
    def block_mask(self) -> BlockMask:
        """FlexAttention's block mask of the table (:func:`~moerl.megatron.segments.block_mask`)."""
        return block_mask(self.table)


class SegmentAttention(DotProductAttention):
    """megatron-core's local core attention, which also takes a packed row's :class:`PackedSegments`. A dense mask or
    none is megatron-core's own case, as before."""

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if not isinstance(packed_seq_params, PackedSegments):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("a segment table is the whole of a packed row's structure: no mask, no bias")
        length = packed_seq_params.table.shape[1]
        if query.shape[1] != 1 or query.shape[0] != length:
            raise ValueError(
                f"a segment table describes one packed row of {length} positions; the queries are "
                f"{query.shape[1]} row(s) of {query.shape[0]}"
            )
        if query.is_cuda:
            return self.flex(query, key, value, packed_seq_params)
        return super().forward(query, key, value, packed_seq_params.dense_mask, attn_mask_type)

    def flex(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: PackedSegments
    ) -> torch.Tensor:
        """``[sq, 1, heads, dim]`` queries, ``[sk, 1, groups, dim]`` keys and values to ``[sq, 1, heads * dim]``, by
        FlexAttention's kernel (compiled on a GPU) under the segments' block mask, at :func:`flex_width`."""
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("FlexAttention applies no attention dropout: set attention_dropout=0 in the config")
        if self.softmax_offset is not None:
            raise ValueError(f"FlexAttention runs the vanilla softmax, not {self.config.softmax_type!r}")
        if self.config.apply_query_key_layer_scaling:  # a scale per layer: a compiled kernel per layer
            raise ValueError("FlexAttention takes one softmax scale: set apply_query_key_layer_scaling=False")
        mask = segments.block_mask
        length = query.shape[0]
        scale = self.softmax_scale
        # [s, 1, heads, dim] views into the fused QKV projection, to [1, heads, width, dim] rows of their own
        q, k, v = (
            torch.nn.functional.pad(t.permute(1, 2, 0, 3), (0, 0, 0, flex_width(length) - length)).contiguous()
            for t in (query, key, value)
        )
        attend = compiled(flex_attention) if query.is_cuda else flex_attention
        # A short row would otherwise get the decoding kernel, meant for a few queries against a KV cache, which has
        # no backward and finds no configuration for some head sizes.
        options = {"FORCE_USE_FLEX_ATTENTION": True}
        out = attend(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], kernel_options=options)
        check_once(out, q, k, v, segments.table, scale)
        return out[:, :, :length].permute(2, 0, 1, 3).reshape(length, query.shape[1], -1)
