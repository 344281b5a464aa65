"""Attention over a packed row of segments, for megatron-core's local layers.

A packed micro-batch is one row of segments end to end (samples, or a group's shared prompt and its responses). A
position attends causally within its own segment and, for a response fed after its group's prompt, to that prompt
too. The row's structure travels to every layer as a *segment table* in place of the attention mask: int64
``[2, s]``, each position's segment and the segment it may also see (-1: none). Nothing ``s x s`` is built for it on a
GPU: FlexAttention's block-sparse kernel computes only the blocks the table makes visible. Without CUDA (where
FlexAttention has no backward) megatron-core's own attention takes the explicit mask the table gives.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from moerl.errors import MoerlError


def segment_table(segments: torch.Tensor, also: torch.Tensor) -> torch.Tensor:
    """int64 ``[2, s]``: each position's segment, and the one (its group's prompt) it also sees, -1 for none."""
    return torch.stack([segments, also]).to(torch.int64)


def is_segment_table(mask: torch.Tensor | None) -> bool:
    return mask is not None and mask.dim() == 2 and mask.shape[0] == 2 and not mask.dtype.is_floating_point


def dense_mask(table: torch.Tensor) -> torch.Tensor:
    """bool ``[1, 1, s, s]``, True where a query may not attend to a key: megatron-core's mask convention."""
    segment, also = table[0], table[1]
    positions = torch.arange(segment.numel(), device=table.device)
    visible = (segment[:, None] == segment[None, :]) | (also[:, None] == segment[None, :])
    return (~visible | (positions[None, :] > positions[:, None]))[None, None]


def flex_width(length: int) -> int:
    """The length FlexAttention computes a row of ``length`` positions at: the next power of two, at least 1024. Its
    kernels are compiled for static shapes (for dynamic lengths, torch 2.11 on an H200, a trainer step's loss came out
    2.6% off the unshared step's), once per width: rows up to 64K take at most 7, within torch's default limit of 8
    compiles a function (past it, torch would run FlexAttention uncompiled, with dense scores). The padding costs
    little: its own segment, it computes only the blocks on the diagonal."""
    return max(1024, 1 << (length - 1).bit_length())


def block_mask(table: torch.Tensor) -> BlockMask:
    """The table, padded to :func:`flex_width` by a segment of its own, as FlexAttention's block mask: built by a
    compiled kernel on a GPU, without an ``s x s`` tensor."""
    length = table.shape[1]
    width = flex_width(length)
    # The padding's segment id, ``length``, is no real one's (each holds a position); -1: it sees no prompt.
    padding = torch.tensor([[length], [-1]], dtype=table.dtype, device=table.device).expand(2, width - length)
    segment, also = torch.cat([table, padding], dim=1)

    def visible(b, h, q, k):
        return (k <= q) & ((segment[k] == segment[q]) | (segment[k] == also[q]))

    build = _compiled(create_block_mask) if table.is_cuda else create_block_mask
    return build(visible, None, None, width, width, device=table.device)


def _same(held: torch.Tensor, table: torch.Tensor) -> bool:
    """``table`` is ``held`` or a view of all of it (activation recompute hands a layer its saved inputs detached):
    while ``held`` lives no other tensor takes its memory."""
    return table is held or (
        table.data_ptr() == held.data_ptr() and table.shape == held.shape and table.device == held.device
    )


# Shapes whose compiled kernel has been checked (check_rows): each compiles once.
_checked: set[tuple[torch.Size, torch.dtype, torch.device]] = set()
# What a kernel may differ from an fp32 reference by, relative to the largest output: its own rounding, no more.
_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}


class KernelMismatch(MoerlError):
    """FlexAttention's kernel gave other outputs than the attention it stands for."""


def check_rows(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, scale):
    """Up to 64 query rows of FlexAttention's output ``out`` (``[1, heads, width, dim]`` of ``q``, ``k``, ``v``) against
    attention computed for them in fp32 from the table. A kernel compiled for a new shape is checked once, before its
    outputs are used: a wrong one would train on garbage without a sign."""
    length = table.shape[1]
    with torch.no_grad():
        rows = torch.linspace(0, length - 1, min(length, 64), device=q.device).long()
        keys = torch.arange(length, device=q.device)
        segment, also = table[0], table[1]
        sees = (keys[None, :] <= rows[:, None]) & (
            (segment[None, :] == segment[rows][:, None]) | (segment[None, :] == also[rows][:, None])
        )
        repeat = q.shape[1] // k.shape[1]
        keys_, values = (t[0, :, :length].float().repeat_interleave(repeat, dim=0) for t in (k, v))
        scores = (q[0, :, rows].float() @ keys_.transpose(1, 2) * scale).masked_fill(~sees, float("-inf"))
        expected = scores.softmax(dim=-1) @ values
        gap = ((out[0, :, rows].float() - expected).abs().max() / expected.abs().max()).item()
    if not gap <= _TOLERANCE[q.dtype]:
        raise KernelMismatch(
            f"FlexAttention's kernel (torch {torch.__version__}) differs from the attention it computes by {gap:.3g} "
            f"of its largest output at {tuple(q.shape)} {q.dtype}: set trainer.micro_batch_format=padded, which runs "
            "megatron-core's own attention"
        )


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


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
        if query.shape[1] != 1:
            raise ValueError(f"a segment table describes one packed row; the batch has {query.shape[1]}")
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
        mask = self._mask_of(table, flex=True)
        length = query.shape[0]
        # megatron-core divides the scale by the layer number under query-key layer scaling and multiplies the scores
        # back in its softmax: the product is the plain scale.
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        # [s, 1, heads, dim] views into the fused QKV projection, to [1, heads, width, dim] rows of their own
        q, k, v = (
            torch.nn.functional.pad(t.permute(1, 2, 0, 3), (0, 0, 0, flex_width(length) - length)).contiguous()
            for t in (query, key, value)
        )
        attend = _compiled(flex_attention) if query.is_cuda else flex_attention
        # A short row would otherwise get the decoding kernel, meant for a few queries against a KV cache, which has
        # no backward and finds no configuration for some head sizes.
        options = {"FORCE_USE_FLEX_ATTENTION": True}
        out = attend(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], kernel_options=options)
        if (shape := (q.shape, q.dtype, q.device)) not in _checked:
            check_rows(out, q, k, v, table, scale)
            _checked.add(shape)
        return out[:, :, :length].permute(2, 0, 1, 3).reshape(length, query.shape[1], -1)

    @classmethod
    def _mask_of(cls, table: torch.Tensor, flex: bool) -> torch.Tensor | BlockMask:
        cached = cls._cached
        if cached is None or not _same(cached[0], table) or isinstance(cached[1], BlockMask) != flex:
            # Held with its table: a later table cannot take the same memory while this one is cached.
            cls._cached = cached = (table, block_mask(table) if flex else dense_mask(table))
        return cached[1]
