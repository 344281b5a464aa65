"""Batch distribution: global rank 0 holds the step's samples, and each rank receives only its own.

Rank 0 plans each instalment of a step: GRPO advantages and aggregation weights over the whole instalment, and
the token-balanced data-parallel shards (:func:`~moerl.trainer.batch.shard_by_tokens`). Every rank
receives the plan, a few numbers per sample (lengths, advantages, weights, temperatures, kept-set sizes, and
for an instalment holding agent episodes the actions of each sample), so all agree on the shards and on the micro-batch
count without further talk. Then each rank receives, as one flat tensor, only its own shard and only what its
pipeline stage reads: token ids on the first stage (its inputs) and the last (its targets); behaviour log-probs,
versions and kept sets of the actions on the last, with the loss mask of each sample that has context (a byte per
response token; single-turn samples send none) and, with distillation on, the teacher's log-prob of each action (over
its kept set where kept sets travel) and its first ``top_k`` top-k ids and log-probs, and, with process credit on
(``trainer.loss.credit``), each action's advantage, which rank 0 computes from the step rewards
(:func:`~moerl.trainer.objectives.process_advantages`; the plan keeps each sample's outcome advantage); routing on every
stage that has MoE layers, only those layers' columns. An outcome-only run sends no per-action advantages.
Tensor-parallel peers of a replica receive the same samples: rank 0 sends them once, point to point, to the
TP group's first rank, which broadcasts them within the group. So a rank's host memory for routing is
proportional to its own tokens and layers, and nothing batch-sized goes to every rank; rank 0's device holds at
most :data:`SCATTER_WINDOW_BYTES` of the others' payloads at a time.

Between two instalments rank 0 may call an :class:`Interlude` instead: every rank stops to do the same collective thing
(the job's: a weight sync to an engine that came back while the step waited, a checkpoint before it stops), then the
step goes on. The weights have not changed since the last update: the optimizer steps after the last instalment.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from moerl.megatron.parallel import collective_device
from moerl.sample import Sample
from moerl.trainer import objectives
from moerl.trainer.batch import carried, prefix_disagreements, shard_by_tokens, shared_runs, unit_length
from moerl.trainer.config import TrainerConfig

ROUTING_DTYPES = (np.uint8, np.int16, np.int32)  # what the sample contract allows, by code in the header
_PIECE, _END, _FAILED, _INTERLUDE = 1, 0, -1, 2  # header status
_PLAN_ROWS = ("prompt_len", "response_len", "advantage", "weight", "temperature", "kept")
# trainer.shared_prompt adds the prompt tokens each sample shares with the one before it (of its group: the group's
# prompt, an episode's history before a fork), then an instalment with context (agent episodes) each sample's action
# count
# the header's flags: kept sets travel; the plan has the actions row; the teacher's log-probs travel (its top-k
# columns, maybe 0, in the header's last slot); each action's advantage travels (process credit)
_MASKS, _CONTEXT, _TEACHER, _PROCESS = 1, 2, 4, 8
_HEADER = 6  # status, n (or an interlude's kind), routing dtype code, routing topk, flags, the teacher's top-k
_ALIGN = 8
# Rank 0's payloads for the other ranks wait on its GPU (NCCL sends from there) at most this many bytes at a time,
# one payload larger than it alone: a step's whole batch staged at once (GBs at 32K-token responses) would not fit
# beside the model, and this much sits within the tenth of the GPU the memory plan leaves free.
SCATTER_WINDOW_BYTES = 256 << 20
# ``(name, dtype, shape)`` of one array of a rank's payload (:func:`_fields`).
_Field: TypeAlias = tuple[str, np.dtype, tuple[int, ...]]


class BatchFailed(RuntimeError):
    """Global rank 0 could not plan an instalment of the batch; its own error says why."""


@dataclass(frozen=True)
class Interlude:
    """What rank 0's source yields in place of an instalment for every rank to stop and do ``kind`` (the caller's
    code)."""

    kind: int


@dataclass(frozen=True)
class Needs:
    """What one rank reads of its samples."""

    dp_rank: int
    ids: bool  # first stage (inputs) or last (targets)
    last: bool  # the loss: behaviour log-probs, versions, kept sets
    columns: tuple[int, ...]  # the rollout-routing columns (MoE layers) of its routers, in build order


@dataclass
class LocalInstalment:
    """One instalment of a step as this rank trains on it."""

    # this replica's shard in instalment order; arrays its stage does not read are zeros made here
    samples: list[Sample]
    advantages: np.ndarray  # float64, per local sample: its outcome advantage
    weights: np.ndarray  # float64, per local sample: its part of the aggregation
    shard_lengths: list[list[int]]  # fed lengths of every replica's shard: all ranks agree on the micro-batch count
    action_counts: np.ndarray  # of every sample of the instalment: the step's normaliser counts them all
    routing: bool  # the samples carry routing (this rank's columns only)
    received: int  # bytes this rank took in for it (plan and shard)
    originals: list[list[Sample]] | None = None  # global rank 0 only: each replica's shard as given, before the wire
    # trainer.shared_prompt: per replica's shard, the tokens each sample shares with the one before it there
    shard_shared: list[list[int]] | None = None
    # global rank 0, trainer.shared_prompt: the instalment's shared prefixes' positions whose routing differs between
    # samples
    prompt_disagreements: int = 0
    # process credit, last stage: per local sample, float32 [actions], each action's advantage (None: each sample's
    # advantage holds for all its actions)
    token_advantages: list[np.ndarray] | None = None

    def advantage(self, i: int) -> float | np.ndarray:
        """Local sample ``i``'s advantage: per action where those travel, else its one value."""
        return float(self.advantages[i]) if self.token_advantages is None else self.token_advantages[i]


def _finish(tensor: torch.Tensor, request: dist.Work) -> int:
    """Wait for ``tensor``'s send; its bytes, free for the next staging once this returns."""
    request.wait()
    if tensor.is_cuda:  # an NCCL wait only orders the streams: the send is done, and its memory free, after this
        torch.cuda.current_stream(tensor.device).synchronize()
    return tensor.numel()


def _fields(
    needs: Needs,
    prompt: np.ndarray,
    response: np.ndarray,
    kept: np.ndarray,
    actions: np.ndarray,
    routing: tuple | None,
    masks: bool,
    skips: np.ndarray,
    teacher: int | None = None,
    process: bool = False,
) -> list[_Field]:
    """``(name, dtype, shape)`` of each array a rank with ``needs`` receives for the samples of these lengths;
    ``skips``: the prompt tokens each shares with the sample before it, whose ids and routing it does not send;
    ``teacher``: the teacher's top-k columns that travel with its log-probs (None: no teacher); ``process``: each
    action's advantage travels."""
    fields: list[_Field] = []
    sent = prompt - skips  # prompt tokens sent per sample
    if needs.ids:
        fields.append(("ids", np.dtype(np.int32), (int((sent + response).sum()),)))
    if needs.last:
        tokens = int(actions.sum())  # context's values are the contract's constants: made on arrival
        fields += [("behaviour", np.dtype(np.float32), (tokens,)), ("versions", np.dtype(np.int64), (tokens,))]
        if masks:
            fields += [
                ("kept_counts", np.dtype(np.int32), (tokens,)),
                ("kept_ids", np.dtype(np.int32), (int(kept.sum()),)),
            ]
        if teacher is not None:
            fields.append(("teacher", np.dtype(np.float32), (tokens,)))
        if teacher:
            fields += [
                ("teacher_top_ids", np.dtype(np.int32), (tokens, teacher)),
                ("teacher_top_logprobs", np.dtype(np.float32), (tokens, teacher)),
            ]
        if process:
            fields.append(("advantages", np.dtype(np.float32), (tokens,)))
        context = actions < response
        if context.any():
            fields.append(("loss_mask", np.dtype(np.uint8), (int(response[context].sum()),)))
    if routing is not None:  # a stage without MoE layers gets zero columns
        dtype, topk = routing
        fields.append(("routing", np.dtype(dtype), (int((sent + response - 1).sum()), len(needs.columns), topk)))
    return fields


def _shared_prefixes(instalment: list[Sample]) -> list[int]:
    """Per sample of ``instalment``: the tokens its prompt shares with the fed tokens of the sample before it, where
    both are of one group (a group's prompt; an episode's history before a fork, and the episodes' common part); else
    0."""
    out = [0] * len(instalment)
    for i in range(1, len(instalment)):
        this, before = instalment[i], instalment[i - 1]
        if this.group_id == before.group_id:
            fed = before.fed_ids()
            n = min(this.prompt_len, len(fed))
            differ = np.flatnonzero(np.asarray(this.prompt_ids[:n]) != np.asarray(fed[:n]))
            out[i] = int(differ[0]) if len(differ) else n
    return out


def _spans(fields: list[_Field]) -> tuple[list[tuple[int, int]], int]:
    spans, offset = [], 0
    for _, dtype, shape in fields:
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        spans.append((offset, offset + size))
        offset += -(-size // _ALIGN) * _ALIGN
    return spans, offset


def _pack(
    samples: list[Sample],
    needs: Needs,
    fields: list[_Field],
    masks: bool,
    skips: np.ndarray,
    advantages: list[np.ndarray] | None = None,
) -> np.ndarray:
    """The payload of ``fields`` for ``samples``; ``advantages``: each sample's per-action advantages, where they
    travel."""
    spans, total = _spans(fields)
    buffer = np.zeros(total, dtype=np.uint8)
    skip = skips.tolist()  # a shared prefix's tokens, sent once
    for (name, dtype, shape), (start, end) in zip(fields, spans, strict=True):  # a span per field
        if name == "ids":
            parts = [np.concatenate([s.prompt_ids, s.response_ids])[k:] for s, k in zip(samples, skip, strict=True)]
        elif name == "behaviour":
            parts = [s.at_actions(carried(s.selected_logprobs) if masks else s.behaviour_logprobs) for s in samples]
        elif name == "versions":
            parts = [s.at_actions(s.versions) for s in samples]
        elif name == "kept_counts":
            parts = [s.at_actions(np.diff(carried(s.mask_offsets))) for s in samples]
        elif name == "kept_ids":
            parts = [carried(s.mask_ids) for s in samples]
        elif name == "teacher":
            parts = [
                s.at_actions(carried(s.teacher_selected_logprobs if masks else s.teacher_logprobs)) for s in samples
            ]
        elif name in ("teacher_top_ids", "teacher_top_logprobs"):  # the first k columns of what a sample holds
            parts = [s.at_actions(carried(getattr(s, name))[:, : shape[1]]) for s in samples]
        elif name == "advantages":
            assert advantages is not None, "the advantages field travels only with per-action advantages"
            parts = advantages
        elif name == "loss_mask":  # the samples with context (as _fields counts them)
            parts = [carried(s.loss_mask) for s in samples if s.action_count < s.response_len]
        else:
            parts = [carried(s.routing)[k:, list(needs.columns)] for s, k in zip(samples, skip, strict=True)]
        array = np.concatenate([np.asarray(p, dtype=dtype) for p in parts]).reshape(shape)
        buffer[start:end] = array.reshape(-1).view(np.uint8)
    return buffer


def _spread(values: np.ndarray, loss_mask: np.ndarray | None, fill: float) -> np.ndarray:
    """Per-action ``values`` (rows) at their response tokens, ``fill`` at context (what the sample contract holds
    there)."""
    if loss_mask is None:
        return values
    out = np.full((len(loss_mask), *values.shape[1:]), fill, dtype=values.dtype)
    out[loss_mask.astype(bool)] = values
    return out


def _arrays(buffer: np.ndarray, fields: list[_Field]) -> dict[str, np.ndarray]:
    """Each field of a payload, by name: views into ``buffer``."""
    spans, _ = _spans(fields)
    return {
        name: buffer[start:end].view(dtype).reshape(shape)
        for (name, dtype, shape), (start, end) in zip(fields, spans, strict=True)  # a span per field
    }


def _token_advantages(buffer: np.ndarray, fields: list[_Field], actions: np.ndarray) -> list[np.ndarray] | None:
    """Per sample of a payload, its actions' advantages (``actions``: each one's count), where they travel; else
    None."""
    arrays = _arrays(buffer, fields)
    if "advantages" not in arrays:
        return None
    return np.split(arrays["advantages"], np.cumsum(actions)[:-1])


def _unpack(
    buffer: np.ndarray,
    fields: list[_Field],
    prompt: np.ndarray,
    response: np.ndarray,
    temperature: np.ndarray,
    actions: np.ndarray,
    skips: np.ndarray,
) -> list[Sample]:
    """The samples of a payload; each takes its first ``skips`` prompt tokens (ids, routing) from the one before it."""
    arrays = _arrays(buffer, fields)
    sent = prompt - skips
    ids_at = np.concatenate([[0], np.cumsum(sent + response)])
    actions_at = np.concatenate([[0], np.cumsum(actions)])
    fed_at = np.concatenate([[0], np.cumsum(sent + response - 1)])
    context = actions < response
    masks_at = np.concatenate([[0], np.cumsum(np.where(context, response, 0))])
    kept_at = np.concatenate([[0], np.cumsum(arrays["kept_counts"])]) if "kept_counts" in arrays else None
    samples: list[Sample] = []
    for i, (p, r) in enumerate(zip(prompt.tolist(), response.tolist(), strict=True)):  # both per sample
        acted = slice(actions_at[i], actions_at[i + 1])
        if "ids" in arrays:
            ids = arrays["ids"][ids_at[i] : ids_at[i + 1]]
            if skips[i]:
                before = np.concatenate([samples[-1].prompt_ids, samples[-1].response_ids])
                ids = np.concatenate([before[: skips[i]], ids]).astype(np.int32)
            prompt_ids, response_ids = ids[:p], ids[p:]
        else:  # a middle stage: inputs come from the previous stage, only the lengths matter here
            prompt_ids, response_ids = np.zeros(p, dtype=np.int32), np.zeros(r, dtype=np.int32)
        loss_mask = arrays["loss_mask"][masks_at[i] : masks_at[i + 1]] if "loss_mask" in arrays and context[i] else None
        if "behaviour" in arrays:  # the last stage
            behaviour = _spread(arrays["behaviour"][acted], loss_mask, 0.0)
            versions = _spread(arrays["versions"][acted], loss_mask, -1)
        else:
            behaviour, versions = np.zeros(r, dtype=np.float32), np.zeros(r, dtype=np.int64)
        routing = arrays["routing"][fed_at[i] : fed_at[i + 1]] if "routing" in arrays else None
        if routing is not None and skips[i]:
            routing = np.concatenate([carried(samples[-1].routing)[: skips[i]], routing])
        sample = Sample(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            behaviour_logprobs=behaviour,
            versions=versions,
            temperature=float(temperature[i]),
            routing=routing,
            loss_mask=loss_mask,
        )
        if kept_at is not None:
            counts = _spread(arrays["kept_counts"][acted].astype(np.int64), loss_mask, 0)
            sample.selected_logprobs = behaviour
            sample.mask_offsets = np.concatenate([[0], np.cumsum(counts)])
            sample.mask_ids = arrays["kept_ids"][kept_at[actions_at[i]] : kept_at[actions_at[i + 1]]]
        if "teacher" in arrays:  # over the kept sets where they travel, as the behaviour log-probs are
            sample.teacher_logprobs = _spread(arrays["teacher"][acted], loss_mask, 0.0)
            if kept_at is not None:
                sample.teacher_selected_logprobs = sample.teacher_logprobs
        if "teacher_top_ids" in arrays:
            sample.teacher_top_ids = _spread(arrays["teacher_top_ids"][acted], loss_mask, 0)
            sample.teacher_top_logprobs = _spread(arrays["teacher_top_logprobs"][acted], loss_mask, 0.0)
        samples.append(sample)
    return samples


class BatchDistributor:
    """Hands each trainer rank its own part of the step's instalments (see the module's docstring). Built once per
    trainer on every rank (collective: rank 0 learns what each rank reads); :meth:`instalments` is collective too."""

    def __init__(self, cfg: TrainerConfig, columns: list[int]):
        """``columns``: the rollout-routing column (MoE layer) of each of this rank's routers, in build order."""
        self.cfg = cfg
        self.share_row = len(_PLAN_ROWS) if cfg.shared_prompt else None
        self.actions_row = len(_PLAN_ROWS) + cfg.shared_prompt
        ps = parallel_state
        self.needs = Needs(
            dp_rank=ps.get_data_parallel_rank(),
            ids=ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage(),
            last=ps.is_pipeline_last_stage(),
            columns=tuple(columns),
        )
        self.dp_size = ps.get_data_parallel_world_size()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Rank 0 sends each replica's stage once, to the first rank of its TP group, which passes it on to its TP peers.
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_first = dist.get_global_rank(self.tp_group, 0)
        # Each rank's (needs, whether it is its TP group's first), on rank 0; gather_object replaces every placeholder.
        everyone: list[tuple[Needs, bool]] | None = [(self.needs, False)] * self.world if self.rank == 0 else None
        dist.gather_object((self.needs, self.rank == self.tp_first), everyone, dst=0)  # once: a few numbers per rank
        self.everyone: list[Needs] = [needs for needs, _ in everyone or []]
        self.receivers = [rank for rank, (_, first) in enumerate(everyone or []) if first and rank != 0]
        self.received = 0  # bytes taken in over this distributor's life
        self.staged_peak = 0  # global rank 0: the most bytes of other ranks' payloads it has held on the device at once

    def instalments(
        self,
        source: Iterable[list[Sample] | Interlude] | None,
        interlude: Callable[[int], None] | None = None,
        arriving: Callable[[], None] | None = None,
    ) -> Iterator[LocalInstalment]:
        """This rank's part of each instalment ``source`` (read on rank 0 only: whole GRPO groups) yields, until it
        ends. An :class:`Interlude` it yields instead runs ``interlude(kind)`` on every rank, all together.
        ``arriving()`` runs on every rank once an instalment is announced, before its bytes travel (see
        :meth:`scatter`)."""
        feed: Iterator[list[Sample] | Interlude] | None = None  # rank 0's instalments
        if self.rank == 0:
            assert source is not None, "global rank 0 reads the instalments"
            feed = iter(source)
        instalment: list[Sample] | Interlude | None = None
        while True:
            if feed is not None:
                try:
                    instalment = next(feed, None)
                    if isinstance(instalment, Interlude) and interlude is None:
                        raise ValueError(f"an interlude ({instalment.kind}) in a step given no interlude to run")
                except BaseException:
                    self._header(_FAILED)
                    raise
            local = self.scatter(instalment, arriving)
            if local is None:
                return
            if isinstance(local, Interlude):
                assert interlude is not None, "rank 0 sends an interlude only to a step given one to run"
                interlude(local.kind)
                continue
            yield local

    def scatter(
        self, instalment: list[Sample] | Interlude | None, arriving: Callable[[], None] | None = None
    ) -> LocalInstalment | Interlude | None:
        """Collective: rank 0 plans ``instalment`` (None: the end) and sends each rank its part; this rank's part, None
        at the end (an interlude: itself, on every rank). ``arriving()`` runs on every rank once the instalment is
        announced, before the tensor-parallel groups pass it on (a colocated trainer's communicators come back then)."""
        if self.rank != 0:
            return self._receive(arriving)
        if instalment is None:
            self._header(_END)
            return None
        if isinstance(instalment, Interlude):
            self._header(_INTERLUDE, instalment.kind)
            return instalment
        try:  # everything that can fail, before any rank is told an instalment is coming
            plan, routing, masks, teacher, process = self._plan(instalment)
            lengths, shards = self._lengths(plan)
            # (fields, payload); tensor-parallel peers read the same: packed once
            packed: dict[Needs, tuple[list[_Field], np.ndarray]] = {}
            for needs in self.everyone:
                if needs not in packed:
                    shard = shards[needs.dp_rank]
                    prompt, response, kept, actions = lengths[:, shard]
                    skips = self._skips(plan, shard)
                    fields = _fields(
                        needs, prompt, response, kept, actions, routing, masks, skips, teacher, process is not None
                    )
                    advantages = None if process is None else [process[i] for i in shard]
                    packed[needs] = (
                        fields,
                        _pack([instalment[i] for i in shard], needs, fields, masks, skips, advantages),
                    )
            payloads = [packed[needs][1] for needs in self.everyone]
        except BaseException:
            self._header(_FAILED)
            raise
        self._header(
            _PIECE,
            len(instalment),
            routing,
            masks,
            context=len(plan) > self.actions_row,
            teacher=teacher,
            process=process is not None,
        )
        if arriving is not None:
            arriving()
        dist.broadcast(torch.from_numpy(plan).to(collective_device()), 0)
        sends = self._send_within_window([(rank, payloads[rank]) for rank in self.receivers])
        self._to_tp_peers(torch.from_numpy(payloads[0]).to(collective_device()))
        for _, request in sends:
            request.wait()
        # Rank 0's own part is unpacked like everyone else's: every rank trains on what the wire format carries.
        local = self._local(plan, lengths, shards, packed[self.needs][0], payloads[0], routing, received=0)
        local.originals = [[instalment[i] for i in shard] for shard in shards]
        if self.share_row is not None and routing is not None:  # a follower's own prefix routing stays here
            local.prompt_disagreements = sum(
                prefix_disagreements([instalment[i] for i in shard], self._skips(plan, shard).tolist())
                for shard in shards
            )
        return local

    def _send_within_window(self, payloads: list[tuple[int, np.ndarray]]) -> deque[tuple[torch.Tensor, dist.Work]]:
        """Send each ``(rank, payload)``, staged on the collective device with at most :data:`SCATTER_WINDOW_BYTES`
        there at once; the sends still in flight, each with its tensor. Every receiver waits in its receive already,
        so waiting for one send before staging the next cannot stall."""
        in_flight: deque[tuple[torch.Tensor, dist.Work]] = deque()
        staged = 0
        for rank, payload in payloads:
            while in_flight and staged + payload.nbytes > SCATTER_WINDOW_BYTES:
                staged -= _finish(*in_flight.popleft())
            tensor = torch.from_numpy(payload).to(collective_device())
            request = dist.isend(tensor, rank)
            assert request is not None, "isend gives None only to a rank outside the group, not in the default one"
            in_flight.append((tensor, request))
            staged += payload.nbytes
            self.staged_peak = max(self.staged_peak, staged)
        return in_flight

    def _plan(
        self, instalment: list[Sample]
    ) -> tuple[np.ndarray, tuple | None, bool, int | None, list[np.ndarray] | None]:
        """(the plan [rows, n] float64, routing (dtype, topk) or None, whether kept sets travel, the teacher's top-k
        columns that travel with its log-probs or None: no teacher, each sample's per-action advantages or None: no
        process credit). The plan has the actions row only where some sample has context."""
        if not instalment:
            raise ValueError("an empty instalment of a batch")
        if len(instalment) < self.dp_size:
            raise ValueError(
                f"{len(instalment)} samples cannot feed {self.dp_size} data-parallel ranks: "
                f"give each instalment at least {self.dp_size}"
            )
        replay, loss = self.cfg.replay, self.cfg.loss
        masks = replay.sampling_mask
        if masks:
            missing = sum(s.selected_logprobs is None or s.mask_offsets is None for s in instalment)
            if missing:
                raise ValueError(
                    f"sampling-mask replay is on but {missing} sample(s) carry no kept sets or selected "
                    "log-probs (request return_sampling_mask with sampling_logprobs_mode='selected')"
                )
        teacher = self._teacher(instalment, masks)
        with_routing = [s.routing is not None for s in instalment]
        routing = None
        if all(with_routing):  # R3 replays it; otherwise it measures agreement
            rollout = [carried(s.routing) for s in instalment]
            dtypes = {r.dtype for r in rollout}
            if len(dtypes) != 1 or next(iter(dtypes)) not in ROUTING_DTYPES:
                raise ValueError(
                    f"routing dtypes {sorted(map(str, dtypes))}: "
                    f"expected one of {[np.dtype(d).name for d in ROUTING_DTYPES]}"
                )
            routing = (next(iter(dtypes)), rollout[0].shape[2])
        elif replay.routing == "R3":
            raise ValueError(
                f"routing replay R3 is on but {len(instalment) - sum(with_routing)} sample(s) carry no routing "
                "(request return_routed_experts)"
            )
        rewards, groups = np.array([s.reward for s in instalment]), np.array([s.group_id for s in instalment])
        response = np.array([s.response_len for s in instalment])
        actions = np.array([s.action_count for s in instalment])
        advantages = objectives.grpo_advantages(
            rewards, groups, loss.std_normalize, episodes=[s.episode for s in instalment]
        )
        # process credit: each action's own advantage, from the outcome's and the step rewards; to the last stage
        process = objectives.process_advantages(instalment, advantages, loss) if loss.credit.process else None
        rows = [
            np.array([s.prompt_len for s in instalment], dtype=np.float64),
            response.astype(np.float64),
            advantages.astype(np.float64),
            objectives.sample_weights(actions, loss.aggregation).astype(np.float64),
            np.array([s.temperature for s in instalment], dtype=np.float64),
            np.array([len(carried(s.mask_ids)) if masks else 0 for s in instalment], dtype=np.float64),
        ]
        if self.share_row is not None:
            rows.append(np.array(_shared_prefixes(instalment), dtype=np.float64))
        if np.any(actions < response):  # single-turn instalments keep the plan's bytes as they were
            rows.append(actions.astype(np.float64))
        return np.stack(rows), routing, masks, teacher, process

    def _teacher(self, instalment: list[Sample], masks: bool) -> int | None:
        """The teacher's top-k columns that travel with its log-probs (0: none), where distillation is on (else None),
        once every sample is found to carry what the loss reads of the teacher."""
        distill = self.cfg.loss.distill
        if not distill.enabled:
            return None
        k = distill.top_k
        missing = {
            "teacher_logprobs": sum(s.teacher_logprobs is None for s in instalment),
            # with masks the loss's old log-probs are over the kept sets: so must the teacher's be
            "teacher_selected_logprobs": sum(s.teacher_selected_logprobs is None for s in instalment) if masks else 0,
            f"teacher_top_ids with >= {k} columns": (
                sum(s.teacher_top_ids is None or s.teacher_top_ids.shape[1] < k for s in instalment) if k else 0
            ),
        }
        lacking = [f"{n} sample(s) carry no {what}" for what, n in missing.items() if n]
        if lacking:
            raise ValueError(
                f"distillation is on (trainer.loss.distill) but {'; '.join(lacking)} (the teacher scores every sample)"
            )
        return k

    def _header(
        self,
        status: int,
        n: int = 0,
        routing: tuple | None = None,
        masks: bool = False,
        context: bool = False,
        teacher: int | None = None,
        process: bool = False,
    ) -> None:
        code = -1 if routing is None else [np.dtype(d) for d in ROUTING_DTYPES].index(np.dtype(routing[0]))
        flags = _MASKS * masks | _CONTEXT * context | _TEACHER * (teacher is not None) | _PROCESS * process
        header = torch.tensor(
            [status, n, code, routing[1] if routing else 0, flags, teacher or 0],
            dtype=torch.int64,
            device=collective_device(),
        )
        dist.broadcast(header, 0)

    def _receive(self, arriving: Callable[[], None] | None) -> LocalInstalment | Interlude | None:
        header = torch.empty(_HEADER, dtype=torch.int64, device=collective_device())
        dist.broadcast(header, 0)
        status, n, code, topk, flags, teacher_k = header.tolist()
        if status == _END:
            return None
        if status == _INTERLUDE:
            return Interlude(n)
        if status == _FAILED:
            raise BatchFailed("global rank 0 failed while preparing the batch (its error says why)")
        if arriving is not None:
            arriving()
        routing = None if code < 0 else (ROUTING_DTYPES[code], topk)
        rows = self.actions_row + bool(flags & _CONTEXT)
        plan_tensor = torch.empty(rows, n, dtype=torch.float64, device=collective_device())
        dist.broadcast(plan_tensor, 0)
        plan = plan_tensor.cpu().numpy()
        lengths, shards = self._lengths(plan)
        prompt, response, kept, actions = lengths[:, shards[self.needs.dp_rank]]
        skips = self._skips(plan, shards[self.needs.dp_rank])
        teacher = teacher_k if flags & _TEACHER else None
        fields = _fields(
            self.needs,
            prompt,
            response,
            kept,
            actions,
            routing,
            bool(flags & _MASKS),
            skips,
            teacher,
            bool(flags & _PROCESS),
        )
        payload = torch.empty(_spans(fields)[1], dtype=torch.uint8, device=collective_device())
        if self.rank == self.tp_first:
            dist.recv(payload, 0)
        self._to_tp_peers(payload)
        received = header.numel() * 8 + plan_tensor.numel() * 8 + payload.numel()
        return self._local(plan, lengths, shards, fields, payload.cpu().numpy(), routing, received)

    def _to_tp_peers(self, payload: torch.Tensor) -> None:
        """The TP group's first rank hands its payload to the others (they all read the same samples)."""
        if dist.get_world_size(self.tp_group) > 1:
            dist.broadcast(payload, self.tp_first, group=self.tp_group)

    def _skips(self, plan: np.ndarray, shard: list[int]) -> np.ndarray:
        """Per sample of ``shard``: the prompt tokens it shares with the sample before it in the instalment, where that
        one is the one before it in the shard too (it alone sends them); else 0."""
        skips = np.zeros(len(shard), dtype=np.int64)
        if self.share_row is not None and len(shard) > 1:
            after = np.diff(shard) == 1
            skips[1:] = np.where(after, plan[self.share_row, shard[1:]], 0)
        return skips

    def _lengths(self, plan: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
        """(int64 [prompt, response, kept, actions] x samples, each replica's sample indices) of a plan: the same on
        every rank. Without the actions row every response token is an action. Samples sharing a prompt go to one
        replica together, where there are as many shares as replicas."""
        lengths = plan[[0, 1, 5, self.actions_row if len(plan) > self.actions_row else 1]].astype(np.int64)
        fed = (lengths[0] + lengths[1] - 1).tolist()
        if self.share_row is None:
            return lengths, shard_by_tokens(fed, self.dp_size)
        shared = plan[self.share_row].astype(np.int64).tolist()
        units = shared_runs(shared)
        if len(units) < self.dp_size:
            return lengths, shard_by_tokens(fed, self.dp_size)
        sizes = [unit_length(u, shared, fed) for u in units]
        return lengths, [sorted(i for u in shard for i in units[u]) for shard in shard_by_tokens(sizes, self.dp_size)]

    def _local(
        self,
        plan: np.ndarray,
        lengths: np.ndarray,
        shards: list[list[int]],
        fields: list[_Field],
        payload: np.ndarray,
        routing,
        received: int,
    ) -> LocalInstalment:
        shard = shards[self.needs.dp_rank]
        prompt, response, _, actions = lengths
        skips = self._skips(plan, shard)
        samples = _unpack(payload, fields, prompt[shard], response[shard], plan[4, shard], actions[shard], skips)
        self.received += received
        return LocalInstalment(
            samples=samples,
            advantages=plan[2, shard],
            weights=plan[3, shard],
            shard_lengths=[(prompt[s] + response[s] - 1).tolist() for s in shards],
            shard_shared=None if self.share_row is None else [self._skips(plan, s).tolist() for s in shards],
            action_counts=actions,
            routing=routing is not None,
            received=received,
            token_advantages=_token_advantages(payload, fields, actions[shard]),
        )
