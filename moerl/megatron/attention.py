"""Attention over a packed row of segments, for megatron-core's local layers.

A packed micro-batch is one row of segments end to end: samples, or the prefix tree of what a group's samples share
(:func:`~moerl.trainer.batch.prefix_tree`). A position attends causally within its own segment and to its segment's
ancestors. The row's structure travels to every layer as a *segment table* in place of the attention mask
(:func:`~moerl.megatron.segments.segment_table`: per position its segment's index and its subtree's end; the rule is
:func:`~moerl.megatron.segments.sees`). Nothing ``s x s`` is built for it on a GPU: FlexAttention's block-sparse
kernel computes only the blocks the table makes visible. Without CUDA (where FlexAttention has no backward)
megatron-core's own attention takes the explicit mask the table gives.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from moerl.megatron.segments import block_mask, check_once, compiled, dense_mask, flex_width, is_segment_table


def _same(held: torch.Tensor, table: torch.Tensor) -> bool:
    """``table`` is ``held`` or a view of all of it (activation recompute hands a layer its saved inputs detached):
    while ``held`` lives no other tensor takes its memory."""
    return table is held or (
        table.data_ptr() == held.data_ptr() and table.shape == held.shape and table.device == held.device
    )


class SegmentAttention(DotProductAttention):
    """megatron-core's local core attention, which also takes a segment table (see the module) as its mask. A dense
    mask or none is megatron-core's own case, as before."""

    # The last table seen and its mask: every layer of a forward, and their recompute, get the same table.
    _cached: tuple[torch.Tensor, torch.Tensor | BlockMask] | None = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **kwargs):
        if not is_segment_table(attention_mask):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, **kwargs)
        if kwargs.get("packed_seq_params") is not None or attention_bias is not None:
            raise ValueError("a segment table is the whole of a packed row's structure: no THD bounds, no bias")
        if query.shape[1] != 1 or query.shape[0] != attention_mask.shape[1]:
            raise ValueError(
                f"a segment table describes one packed row of {attention_mask.shape[1]} positions; the queries are "
                f"{query.shape[1]} row(s) of {query.shape[0]}"
            )
        if query.is_cuda:
            return self.flex(query, key, value, attention_mask)
        dense = self._mask_of(attention_mask, flex=False)
        assert isinstance(dense, torch.Tensor)
        return super().forward(query, key, value, dense, attn_mask_type, **kwargs)

    def flex(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``[sq, 1, heads, dim]`` queries, ``[sk, 1, groups, dim]`` keys and values to ``[sq, 1, heads * dim]``, by
        FlexAttention's kernel (compiled on a GPU) under the table's block mask, at :func:`flex_width`."""
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("FlexAttention applies no attention dropout: set attention_dropout=0 in the config")
        if self.softmax_offset is not None:
            raise ValueError(f"FlexAttention runs the vanilla softmax, not {self.config.softmax_type!r}")
        if self.config.apply_query_key_layer_scaling:  # a scale per layer: a compiled kernel per layer
            raise ValueError("FlexAttention takes one softmax scale: set apply_query_key_layer_scaling=False")
        mask = self._mask_of(table, flex=True)
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
        check_once(out, q, k, v, table, scale)
        return out[:, :, :length].permute(2, 0, 1, 3).reshape(length, query.shape[1], -1)

    @classmethod
    def _mask_of(cls, table: torch.Tensor, flex: bool) -> torch.Tensor | BlockMask:
        cached = cls._cached
        if cached is None or not _same(cached[0], table) or isinstance(cached[1], BlockMask) != flex:
            # Held with its table: a later table cannot take the same memory while this one is cached.
            cls._cached = cached = (table, block_mask(table) if flex else dense_mask(table))
        return cached[1]
