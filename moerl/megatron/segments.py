"""A packed row's segments, for attention: the segment table each layer takes, its dense mask, FlexAttention's block
mask and the check of a compiled kernel (:class:`~moerl.megatron.attention.SegmentAttention` computes with them). Torch
alone, no megatron-core: the memory plan sizes FlexAttention's rows from here."""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from moerl.errors import MoerlError


def segment_table(enter: torch.Tensor, exit_: torch.Tensor) -> torch.Tensor:
    """int64 ``[2, s]``: per position, its segment's index in the row and the index after that segment's subtree.

    A packed row lays its segments out as a tree in depth-first order: a sample alone is a segment without children;
    a prefix several samples share (a group's prompt, an episode's history before a fork) is a segment whose subtree
    holds what follows it in each. Segment ``a`` is an ancestor of ``b`` (or ``b`` itself) exactly when
    ``enter[a] <= enter[b] < exit[a]``."""
    return torch.stack([enter, exit_]).to(torch.int64)


def sees(table: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Whether each ``query`` position attends to each ``key`` position (broadcast index tensors): causally, within
    its own segment and its ancestors'."""
    enter, exit_ = table[0], table[1]
    return (key <= query) & (enter[key] <= enter[query]) & (enter[query] < exit_[key])


def dense_mask(table: torch.Tensor) -> torch.Tensor:
    """bool ``[1, 1, s, s]``, True where a query may not attend to a key: megatron-core's mask convention."""
    positions = torch.arange(table.shape[1], device=table.device)
    return ~sees(table, positions[:, None], positions[None, :])[None, None]


def flex_width(length: int) -> int:
    """The length FlexAttention computes a row of ``length`` positions at: the next power of two, at least 1024. Its
    kernels are compiled for static shapes (for dynamic lengths, torch 2.11 on an H200, a trainer step's loss came out
    2.6% off the unshared step's), once per width and grad mode: rows up to 128K take at most 16 compiles
    (:data:`RECOMPILE_LIMIT`). The padding costs little: its own segment, it computes only the blocks on the
    diagonal."""
    return max(1024, 1 << (length - 1).bit_length())


def block_mask(table: torch.Tensor) -> BlockMask:
    """The table, padded to :func:`flex_width` by a segment of its own, as FlexAttention's block mask: built by a
    compiled kernel on a GPU, without an ``s x s`` tensor."""
    length = table.shape[1]
    width = flex_width(length)
    # The padding is a segment of its own, after every real one (there are at most ``length``), with no children.
    padding = torch.tensor([[length], [length + 1]], dtype=table.dtype, device=table.device).expand(2, width - length)
    padded = torch.cat([table, padding], dim=1)

    def visible(b, h, q, k):
        return sees(padded, q, k)

    build = compiled(create_block_mask) if table.is_cuda else create_block_mask
    return build(visible, None, None, width, width, device=table.device)


# What a compiled kernel has been checked for (check_once): shape, dtype, device and grad mode, each compiled apart.
_checked: set[tuple[torch.Size, torch.dtype, torch.device, bool]] = set()
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
        visible = sees(table, rows[:, None], keys[None, :])
        repeat = q.shape[1] // k.shape[1]
        keys_, values = (t[0, :, :length].float().repeat_interleave(repeat, dim=0) for t in (k, v))
        scores = (q[0, :, rows].float() @ keys_.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
        expected = scores.softmax(dim=-1) @ values
        gap = ((out[0, :, rows].float() - expected).abs().max() / expected.abs().max()).item()
    if not gap <= _TOLERANCE[q.dtype]:
        raise KernelMismatch(
            f"FlexAttention's kernel (torch {torch.__version__}) differs from the attention it computes by {gap:.3g} "
            f"of its largest output at {tuple(q.shape)} {q.dtype}: set trainer.micro_batch_format=padded, which runs "
            "megatron-core's own attention"
        )


# Compiles of one function torch allows before it runs it uncompiled (FlexAttention then materialises the scores):
# a width compiles once with gradients and once without (the score pass), so 8 widths take 16.
RECOMPILE_LIMIT = 32


@functools.cache
def compiled(fn):
    """``fn`` compiled for static shapes, within :data:`RECOMPILE_LIMIT` compiles."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False)


def check_once(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, scale):
    """:func:`check_rows`, the first time a kernel of this shape, dtype, device and grad mode gives ``out``."""
    if (kernel := (q.shape, q.dtype, q.device, torch.is_grad_enabled())) not in _checked:
        check_rows(out, q, k, v, table, scale)
        _checked.add(kernel)
