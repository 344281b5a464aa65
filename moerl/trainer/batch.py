"""From samples to this rank's micro-batches.

The global batch is split across data-parallel ranks balanced by tokens, then into micro-batches
under a token budget. A micro-batch is padded (``[b, s]``, right-padded rows, the budget counting
the padding) or packed (``[1, s]``: the samples end to end, each attending only to itself); the
actions (response tokens less an agent episode's context) are flattened to ``[T]`` for the loss either way.
Samples arrive carrying only this rank's MoE layers' routing (:mod:`moerl.trainer.distribute`);
:mod:`moerl.trainer.routing` cuts it further to the tokens this rank's routers see, which in packed form is the
packed order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moerl.megatron.forward import host_to_device
from moerl.megatron.segments import segment_table
from moerl.sample import Sample


def shard_by_tokens(lengths: list[int], shards: int) -> list[list[int]]:
    """Sample indices per shard, balancing the token counts (longest first onto the lightest shard).
    Deterministic: ties go to the lowest shard, and each shard keeps its samples in batch order."""
    if len(lengths) < shards:
        raise ValueError(f"{len(lengths)} samples cannot fill {shards} data-parallel ranks")
    loads = [0] * shards
    members: list[list[int]] = [[] for _ in range(shards)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(shards), key=lambda s: (loads[s], s))
        loads[target] += lengths[i]
        members[target].append(i)
    return [sorted(m) for m in members]


def split_by_budget(lengths: list[int], token_budget: int, multiple: int = 1) -> list[list[int]]:
    """Group indices (in order of decreasing length) so each group's padded size ``n * max_len`` fits
    ``token_budget``; a sample longer than the budget gets a group of its own."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if groups:
            width = _round_up(lengths[groups[-1][0]], multiple)  # the group's first sample is its longest
            if (len(groups[-1]) + 1) * width <= token_budget:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def pack_by_budget(lengths: list[int], token_budget: int, multiple: int = 1) -> list[list[int]]:
    """Group indices first-fit in order of decreasing length, so each group's total (rounded up to
    ``multiple``) fits ``token_budget``; a sample longer than the budget gets a group of its own."""
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g, load in enumerate(loads):
            if _round_up(load + lengths[i], multiple) <= token_budget:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    return groups


def split_into(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` split further (the largest first, in halves) until there are ``count`` of them, or
    until every group is a single sample. Expert-parallel ranks must run the same number of
    micro-batches (each one's forward is an all-to-all across them), whatever their shard sizes."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: (len(groups[i]), -i))
        if len(groups[largest]) < 2:
            break
        g = groups.pop(largest)
        groups[largest:largest] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def carried(array: np.ndarray | None) -> np.ndarray:
    """One of a sample's optional arrays (kept sets, selected log-probs, routing, a teacher's) that the plan checked
    every sample of the instalment carries (:meth:`~moerl.trainer.distribute.BatchDistributor._plan`)."""
    assert array is not None, "a sample lacks an array that the plan found on every sample"
    return array


_LOSS_INPUTS = (
    "rows",
    "cols",
    "targets",
    "seq",
    "temperature",
    "weights",
    "advantages",
    "behaviour",
    "versions",
    "mask_offsets",
    "mask_ids",
    "teacher",
    "teacher_top_ids",
    "teacher_top_logprobs",
)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # int64 [b, s]: fed tokens, right-padded; packed: [1, s], samples end to end
    rows: torch.Tensor  # int64 [T]: batch row of each action (a response token the model sampled)
    cols: torch.Tensor  # int64 [T]: position scoring it
    targets: torch.Tensor  # int64 [T]: the action
    seq: torch.Tensor  # int64 [T]: sample index within the micro-batch
    temperature: torch.Tensor  # float32 [T]: the sampling temperature of the token's sample
    weights: torch.Tensor  # float32 [T]: aggregation weight over the global batch
    advantages: torch.Tensor  # float32 [T]: each action's (its sample's outcome advantage, or its own: process credit)
    behaviour: torch.Tensor  # float32 [T]: engine log-probs (full vocab, or over the kept set with masks)
    versions: torch.Tensor  # int64 [T]
    fed_lengths: list[int]
    mask_offsets: torch.Tensor | None = None  # int64 [T+1]: kept sets, CSR over the T tokens
    mask_ids: torch.Tensor | None = None  # int32
    # distillation: float32 [T], the teacher's log-prob of each action (over its kept set with masks)
    teacher: torch.Tensor | None = None
    teacher_top_ids: torch.Tensor | None = None  # int32 [T, k]: the teacher's k most likely ids at each action
    teacher_top_logprobs: torch.Tensor | None = None  # float32 [T, k]: their log-probs (full vocabulary)
    routing: np.ndarray | None = None  # [b, s, local routers, topk] rollout routing of this rank's MoE layers, padded
    old: torch.Tensor | None = None  # float32 [T]: proximal log-probs, filled by the trainer
    ref: torch.Tensor | None = None  # float32 [T]: reference-model log-probs, when a KL term is on
    r2_targets: list[torch.Tensor] | None = None  # R2: routing recorded in the old-policy forward, per local router
    sample_indices: list[int] | None = None  # each sample's index in the rank's instalment
    # bool [T]: the old-policy pass's native experts differ from the rollout's somewhere
    routing_differs: torch.Tensor | None = None
    dummy: bool = False  # a zero-weight copy run only so every expert-parallel rank runs as many micro-batches
    cu_seqlens: torch.Tensor | None = None  # int32 [n+1]: packed form: where each segment starts and ends in the row
    # Packed form with shared prefixes: int64 [segments, 2], per segment (in row order, a depth-first order of their
    # tree) the index after its subtree and the position its first token had in its samples' own sequences. None:
    # every segment is a sample, attending only to itself.
    tree: np.ndarray | None = None

    def loss_inputs_to(self, device: torch.device) -> None:
        """The per-token tensors the passes' log-probs and the loss read, moved to ``device`` once, before any pass,
        without holding the host (:func:`~moerl.megatron.forward.host_to_device`). The model's inputs stay here: each
        forward moves its own."""
        for name in _LOSS_INPUTS:
            if getattr(self, name) is not None:
                setattr(self, name, host_to_device(getattr(self, name), device))

    @property
    def num_seqs(self) -> int:
        return len(self.fed_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    def real_positions(self) -> np.ndarray:
        """bool ``[b, s]``: the positions holding a sample's token rather than padding."""
        width = self.input_ids.shape[1]
        ends = np.asarray(self.fed_lengths) if self.cu_seqlens is None else np.array([int(self.cu_seqlens[-1])])
        return np.arange(width)[None, :] < ends[:, None]

    def packed_inputs(self, device: torch.device, thd: bool) -> dict:
        """Model inputs of the packed form: positions restarting at each sample (what follows a shared prefix
        continuing from it), and megatron-core's packed-sequence parameters: either Transformer Engine's THD
        boundaries (``thd``) or the row's segment table for :class:`~moerl.megatron.attention.SegmentAttention`
        (causal within each segment and to its ancestors, the prefixes it follows). The padding tail is a segment of
        its own."""
        from megatron.core.packed_seq_params import PackedSeqParams

        from moerl.megatron.attention import PackedSegments

        assert self.cu_seqlens is not None, "packed inputs of a padded micro-batch"
        width = self.input_ids.shape[1]
        bounds = self.cu_seqlens.tolist()
        if bounds[-1] < width:
            bounds.append(width)
        lengths = np.diff(bounds)
        exits, offsets = np.arange(1, len(lengths) + 1), np.zeros(len(lengths), dtype=np.int64)
        if self.tree is not None:
            exits[: len(self.tree)], offsets[: len(self.tree)] = self.tree[:, 0], self.tree[:, 1]
        positions = np.concatenate([offset + np.arange(n) for offset, n in zip(offsets, lengths, strict=True)])
        positions_t = host_to_device(torch.from_numpy(positions), device)[None, :]
        if thd:
            assert self.tree is None, "THD packing is block-diagonal: it cannot attend to a shared prefix"
            cu = host_to_device(torch.tensor(bounds, dtype=torch.int32), device)
            longest = int(lengths.max())
            return {
                "position_ids": positions_t,
                "packed_seq_params": PackedSeqParams(
                    qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
                ),
            }
        # Built on the host: repeat_interleave on a GPU reads its output size back, a wait as long as a blocking copy.
        segments = np.repeat(np.arange(len(lengths)), lengths)
        table = segment_table(torch.from_numpy(segments), torch.from_numpy(exits[segments]))
        inputs = {"position_ids": positions_t, "packed_seq_params": PackedSegments(host_to_device(table, device))}
        if self.tree is not None:  # what follows a shared prefix rotated as in its own sequence, after the prefix
            inputs["rope_positions"] = positions_t[0]
        return inputs


def padding_routing(count: int, topk: int, num_experts: int, dtype: np.dtype) -> np.ndarray:
    """Expert sets ``[count, topk]`` for ``count`` padding positions, which still pass through the routers and are
    dispatched by the sets replay gives them. Position ``j`` takes experts ``j + i * (num_experts // topk)`` (mod
    ``num_experts``), ``i < topk``: distinct, and spread evenly over the expert range, of which each expert-parallel
    rank holds a contiguous block, so every position sends each rank its share (exactly, where the EP size divides
    ``topk`` and ``topk`` divides ``num_experts``); and the offset ``j`` rotates, so every ``num_experts`` positions
    give each expert ``topk`` tokens. Experts 0..topk-1 for all of them put the padding on one rank."""
    offsets = np.arange(topk) * (num_experts // topk)
    return ((np.arange(count)[:, None] + offsets) % num_experts).astype(dtype)


def shared_runs(shared: list[int]) -> list[list[int]]:
    """Positions ``0..n-1`` in runs: a sample that shares a prefix with the one before it (``shared`` tokens, > 0)
    joins its run."""
    runs: list[list[int]] = []
    for i, tokens in enumerate(shared):
        if runs and tokens > 0:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def prefix_disagreements(samples: list[Sample], shared: list[int]) -> int:
    """Of the prefixes consecutive ``samples`` share (``shared``: tokens each shares with the one before it), the
    positions where a sample's recorded routing (as sets) differs from the routing the shared forward replays there:
    the earliest sample's that fed the position."""
    count, fed = 0, None
    for sample, tokens in zip(samples, shared, strict=True):
        own = None if sample.routing is None else np.sort(carried(sample.routing), axis=-1)
        if own is not None and fed is not None and tokens > 0:
            count += int((own[:tokens] != fed[:tokens]).any(axis=(1, 2)).sum())
            own = np.concatenate([fed[:tokens], own[tokens:]])
        fed = own
    return count


def shared_units(shared: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """A shard's samples (``shared``: tokens each shares with the one before it; ``lengths``: fed lengths) in units
    the micro-batches keep whole: a run sharing prefixes, cut where the next sample would take the unit past
    ``budget`` (the sample after a cut is fed whole: it shares with nothing before it in the micro-batch)."""
    units: list[list[int]] = []
    for run in shared_runs(shared):
        units.append([run[0]])
        size = lengths[run[0]]
        for i in run[1:]:
            if size + lengths[i] - shared[i] <= budget:
                units[-1].append(i)
                size += lengths[i] - shared[i]
            else:
                units.append([i])
                size = lengths[i]
    return units


def unit_length(unit: list[int], shared: list[int], lengths: list[int]) -> int:
    """The positions a unit takes fed (each shared prefix once)."""
    return lengths[unit[0]] + sum(lengths[i] - shared[i] for i in unit[1:])


@dataclass(eq=False)  # segments are told apart by identity: two may hold equal spans
class _Segment:
    """Fed tokens ``start:end`` of a sample's sequence, fed once for every sample whose path holds them."""

    start: int
    end: int
    parent: _Segment | None = None


def prefix_tree(fed_lengths: list[int], shared: list[int]) -> tuple[list[_Segment], list[list[_Segment]]]:
    """The segments of a row of samples sharing prefixes (sample ``i``'s first ``shared[i]`` tokens are sample
    ``i - 1``'s), in a depth-first order, and each sample's path through them. Each sample attaches where the one before
    it branches, on the last path laid out, so laying segments out as they come is depth-first; a segment a branch
    starts within is split there."""
    segments: list[_Segment] = []
    paths: list[list[_Segment]] = []
    for i, (length, tokens) in enumerate(zip(fed_lengths, shared, strict=True)):
        path: list[_Segment] = []
        if tokens > 0:
            for seg in paths[i - 1]:
                if seg.end <= tokens:
                    path.append(seg)
                    continue
                if seg.start < tokens:  # the branch starts within it: split it there
                    tail = _Segment(tokens, seg.end, seg)
                    for other in segments:
                        if other.parent is seg:
                            other.parent = tail
                    seg.end = tokens
                    segments.insert(segments.index(seg) + 1, tail)
                    for earlier in paths:
                        if seg in earlier:
                            earlier.insert(earlier.index(seg) + 1, tail)
                    path.append(seg)
                break
        if length > tokens:
            segments.append(_Segment(tokens, length, path[-1] if path else None))
            path.append(segments[-1])
        paths.append(path)
    return segments, paths


def build_micro_batch(
    samples: list[Sample],
    advantages: Sequence[float | np.ndarray],
    weights: list[float],
    multiple: int,
    use_masks: bool,
    routed_experts: int | None,
    packed: bool = False,
    shared: list[int] | None = None,
    teacher_top_k: int | None = None,
) -> MicroBatch:
    """One padded (or ``packed``) micro-batch; ``s`` is a multiple of ``multiple`` (the TP size, for
    sequence parallelism). ``advantages``: each sample's, one value for all its actions or (process credit) float32
    [actions], one per action. ``use_masks``: every sample carries kept sets; ``routed_experts``: every sample carries
    routing, and the model has this many routed experts, over which the padding's routing is spread
    (:func:`padding_routing`); None: no routing (checked where the batch is planned,
    :class:`~moerl.trainer.distribute.BatchDistributor`). ``shared`` (packed only): per sample, the tokens of its
    prompt it shares with the sample before it (a group's prompt, an episode's history before a fork; 0: none).
    Shared prefixes are fed once (:func:`prefix_tree`); what follows each attends to it and to itself at the positions
    it had in its own sequence. A shared position takes the routing of the first sample that fed it (the data plane
    sends no other: :func:`prefix_disagreements`). ``teacher_top_k``: every sample carries a teacher's log-probs (over
    the kept sets with ``use_masks``), and, when > 0, at least this many of its top-k columns, of which the first
    ``teacher_top_k`` are taken; None: no teacher."""
    fed_lengths = [s.fed_len for s in samples]
    # Each sample's fed tokens as (row, column) positions of the micro-batch; the packed form's segments and tree.
    if packed:
        segments, paths = prefix_tree(fed_lengths, shared if shared is not None else [0] * len(samples))
        starts = np.cumsum([0] + [seg.end - seg.start for seg in segments])
        column = {id(seg): int(start) for seg, start in zip(segments, starts[:-1], strict=True)}
        where = [
            (0, np.concatenate([column[id(seg)] + np.arange(seg.end - seg.start) for seg in path])) for path in paths
        ]
        bounds = starts.tolist()
        index = {id(seg): k for k, seg in enumerate(segments)}
        exits = np.arange(1, len(segments) + 1)
        for k in reversed(range(len(segments))):  # a subtree ends where its last descendant's does
            parent = segments[k].parent
            if parent is not None:
                exits[index[id(parent)]] = max(exits[index[id(parent)]], exits[k])
        branched = (exits > np.arange(1, len(segments) + 1)).any()
        tree = np.stack([exits, [seg.start for seg in segments]], axis=1) if branched else None
    else:
        where, tree = [(b, np.arange(n)) for b, n in enumerate(fed_lengths)], None
    fed = np.array(fed_lengths)
    width = _round_up(bounds[-1] if packed else int(fed.max()), multiple)
    input_ids = torch.zeros(1 if packed else len(samples), width, dtype=torch.long)
    rows, cols, seq, temps, w, adv = [], [], [], [], [], []
    for b, (s, (row, at)) in enumerate(zip(samples, where, strict=True)):
        input_ids[row, torch.from_numpy(at)] = torch.from_numpy(s.fed_ids().astype(np.int64))
        t = s.action_count  # only actions are scored: context is fed, as the prompt is
        rows.append(np.full(t, row))
        cols.append(s.at_actions(at[s.prompt_len - 1 : s.prompt_len - 1 + s.response_len]))
        seq.append(np.full(t, b))
        temps.append(np.full(t, s.temperature, dtype=np.float32))
        w.append(np.full(t, weights[b], dtype=np.float32))
        adv.append(np.broadcast_to(np.asarray(advantages[b], dtype=np.float32), (t,)))
    cat = lambda parts, dtype=torch.long: torch.from_numpy(np.concatenate(parts)).to(dtype)
    if use_masks:
        behaviour = cat([s.at_actions(carried(s.selected_logprobs)) for s in samples], torch.float32)
    else:
        behaviour = cat([s.at_actions(s.behaviour_logprobs) for s in samples], torch.float32)
    batch = MicroBatch(
        input_ids=input_ids,
        rows=cat(rows),
        cols=cat(cols),
        targets=cat([s.at_actions(s.response_ids) for s in samples]),
        seq=cat(seq),
        temperature=cat(temps, torch.float32),
        weights=cat(w, torch.float32),
        advantages=cat(adv, torch.float32),
        behaviour=behaviour,
        versions=cat([s.at_actions(s.versions) for s in samples]),
        fed_lengths=fed.tolist(),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32) if packed else None,
        tree=tree,
    )
    if use_masks:
        offsets, start = [np.zeros(1, dtype=np.int64)], 0
        for s in samples:
            # Each action's end; context tokens hold no ids, so the ids stay as they are.
            offsets.append(s.at_actions(carried(s.mask_offsets)[1:]).astype(np.int64) + start)
            start += int(carried(s.mask_offsets)[-1])
        batch.mask_offsets = cat(offsets)
        batch.mask_ids = cat([s.mask_ids for s in samples], torch.int32)  # kept sets are the bulk of the loss's inputs
    if teacher_top_k is not None:
        teacher = [s.teacher_selected_logprobs if use_masks else s.teacher_logprobs for s in samples]
        batch.teacher = cat([s.at_actions(carried(t)) for s, t in zip(samples, teacher, strict=True)], torch.float32)
        if teacher_top_k:
            batch.teacher_top_ids = cat(
                [s.at_actions(carried(s.teacher_top_ids)[:, :teacher_top_k]) for s in samples], torch.int32
            )
            batch.teacher_top_logprobs = cat(
                [s.at_actions(carried(s.teacher_top_logprobs)[:, :teacher_top_k]) for s in samples], torch.float32
            )
    if routed_experts is not None:
        some = samples[0].routing
        assert some is not None, "routed_experts: every sample carries routing"
        _, layers, topk = some.shape
        routing = np.empty((*input_ids.shape, layers, topk), dtype=some.dtype)
        for i in reversed(range(len(samples))):  # a shared position: the first sample that fed it writes it last
            row, at = where[i]
            routing[row, at] = samples[i].routing
        padding = ~batch.real_positions()
        routing[padding] = padding_routing(int(padding.sum()), topk, routed_experts, routing.dtype)[:, None]
        batch.routing = routing
    return batch
