"""Every message between the trainer (rank 0's rollout buffer) and the rollout manager, and the manager's
spec file: one type each, written and read only through this module.

Orders go trainer -> manager over one ZMQ PUSH/PULL pair, events manager -> trainer over another; both
carry these dataclasses pickled (the two processes run the same moerl), and each side refuses anything
else, so a message that changes shape fails at the first send, not as a KeyError somewhere later. Events
go through :func:`send_event` and :func:`receive_event`: their samples' arrays out of band.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, overload

from moerl.engines.health import State
from moerl.sample import Sample

if TYPE_CHECKING:
    import zmq
    import zmq.asyncio

MessageT = TypeVar("MessageT")


# ---- orders: trainer -> manager ------------------------------------------------------------------
@dataclass(frozen=True)
class Generate:
    groups: int  # this many more prompts' groups: re-issued prompts first, then new ones from the cursor


@dataclass(frozen=True)
class Updating:
    """A weight update begins: no new request is sent until the next :class:`Served`. One sent meanwhile would wait on a
    paused engine and start under the new weights, keyed to the old version's prefix cache, which the update could not
    flush while requests run (``rollout.partial=in_place``)."""


@dataclass(frozen=True)
class Served:
    """After each weight sync: a replica out of rotation comes back once it is among ``engines`` and reports
    ``weight_version``; a healthy one not among them is stale (it answered too late for the sync). In LoRA runs
    new requests name ``adapter`` from then on. One order, so that the manager changes the rotation and the
    adapter together: no request finds a replica back in rotation under an adapter it does not hold."""

    weight_version: str | None  # what they report (None: a LoRA run, whose base weights keep their version)
    engines: list[str]  # the engines the sync reached
    adapter: str | None = None  # the LoRA adapter the sync loaded on them (None: a full-weight run)
    version: int = 0  # the policy version the adapter holds: the version of every token sampled with it
    also: bool = False  # a catch-up: the replicas the last sync reached still serve the same policy


@dataclass(frozen=True)
class Restarting:
    # replicas whose processes the job has just started again (out of rotation until they serve the policy)
    urls: list[str]


@dataclass(frozen=True)
class Stop:
    """Abort what is in flight and exit; answered by :class:`Stopped`."""


ORDERS: tuple[type[Order], ...] = (Generate, Updating, Served, Restarting, Stop)
Order = Generate | Updating | Served | Restarting | Stop  # one of ORDERS


# ---- events: manager -> trainer ------------------------------------------------------------------
@dataclass(frozen=True)
class Issued:
    index: int  # the prompt's index in the task's stream
    new: bool  # False: a resumed run's re-issue of a prompt its accounting already counts


@dataclass(frozen=True)
class GroupDone:
    """A prompt's group, generated and scored; rank 0 keeps it as it came (rollouts.Group) until a step trains it."""

    index: int
    samples: list[Sample]  # the prompt's completions, scored, per-token versions / routing / kept sets attached
    retries: int = 0  # regenerations after weight updates aborted it (rollout.partial=retry)
    seconds: float = 0.0  # from issue to scored
    engine_retries: int = 0  # re-issues after its replica failed (transport error, deadline)
    workers_lost: int = 0  # re-issues after the generation worker carrying it died (not the replica's failure)
    # rollout.schedule.chunk_tokens: requests that continued a completion cut there, and those of them that ran on
    # another replica than the piece before
    continued: int = 0
    moved: int = 0
    tail: int = 0  # requests placed as tail requests (rollout.schedule.tail_tokens)
    # An agentic group: its episodes' counts summed (EpisodeStats.metrics: turns, tool calls, forks, ...), its episodes
    # and the failed ones by reason (episode/failed_<reason>). None: a single-turn group.
    episodes: dict[str, float] | None = None
    # With a reward model, a process reward model or a teacher: their requests, retries, seconds and sums for the group
    # (<scorer>_engines/*)
    scoring: dict[str, float] | None = None

    def oldest_version(self) -> int:
        """Of the group's oldest model token: an episode's context was produced by no policy."""
        return min(s.oldest_version for s in self.samples)


class DropReason(StrEnum):
    """Why the rollout manager gave a prompt's group up (the accounting's prompts/dropped_<reason>)."""

    ENGINE_FAILURE = "engine_failure"  # its replicas failed more than rollout.engine_retries times
    EPISODE_FAILURE = "episode_failure"  # every episode of an agentic group failed (its agent raised or timed out)
    FILTERED = "filtered"  # rollout.filter_groups turned it away


@dataclass(frozen=True)
class Dropped:
    index: int
    reason: DropReason
    engine_retries: int
    workers_lost: int = 0
    rewards: tuple[float, ...] = ()  # a filtered group's: what the policy scored, though nothing trains on it


@dataclass(frozen=True)
class EnginesChanged:
    states: dict[str, State]  # every replica's URL -> its health state
    losses: dict[str, int]  # every replica's URL -> how many times it lost what the syncs left (ReplicaHealth.losses)


@dataclass(frozen=True)
class RolloutFailed:
    index: int
    message: str  # the exception and its traceback
    engines_down: bool = False  # no replica was healthy for engines.down_timeout_s: the job checkpoints and stops


@dataclass(frozen=True)
class Stopped:
    cancelled: list[int]  # prompts that were in flight at the stop


EVENTS: tuple[type[Event], ...] = (Issued, GroupDone, Dropped, EnginesChanged, RolloutFailed, Stopped)
Event = Issued | GroupDone | Dropped | EnginesChanged | RolloutFailed | Stopped  # one of EVENTS


def checked(message: object, kinds: tuple[type[MessageT], ...]) -> MessageT:
    """``message`` if it is one of ``kinds``; otherwise a TypeError naming what arrived."""
    if not isinstance(message, kinds):
        raise TypeError(
            f"unexpected message {type(message).__name__}: expected one of {', '.join(k.__name__ for k in kinds)}"
        )
    return message


def event_frames(event: Event) -> list[bytes | memoryview]:
    """``event`` as ZMQ frames for a send without copies: its pickle (protocol 5), then each array's bytes out of band.
    A group of long completions carries tens of MB (32 MB at 7.5K tokens of Qwen3-30B-A3B), and pickled in band,
    copied on the way into the pickle, it took half the rollout manager's CPU at 96 engine GPUs."""
    arrays: list[pickle.PickleBuffer] = []
    head = pickle.dumps(event, protocol=5, buffer_callback=arrays.append)
    return [head, *(array.raw() for array in arrays)]


@overload
def send_event(socket: zmq.asyncio.Socket, event: Event) -> Awaitable[zmq.MessageTracker | None]: ...
@overload
def send_event(socket: zmq.Socket[bytes], event: Event) -> zmq.MessageTracker | None: ...
def send_event(
    socket: zmq.Socket[bytes] | zmq.asyncio.Socket, event: Event
) -> zmq.MessageTracker | None | Awaitable[zmq.MessageTracker | None]:
    """Send ``event`` on ``socket`` (a plain or an asyncio ZMQ socket: await what it returns) as :func:`event_frames`;
    the frames hold the arrays until ZMQ has sent them."""
    return socket.send_multipart(event_frames(event), copy=False)


def receive_event(socket: zmq.Socket[bytes]) -> Event:
    """The next event on ``socket`` (plain ZMQ), if it is one of :data:`EVENTS`. Its arrays get memory of their own,
    writable (one copy, as an in-band pickle would make), not the frames' read-only bytes."""
    head, *arrays = (frame.buffer for frame in socket.recv_multipart(copy=False))
    return checked(pickle.loads(head, buffers=[bytearray(array) for array in arrays]), EVENTS)


# ---- the manager's spec file ---------------------------------------------------------------------
@dataclass(frozen=True)
class ServedModel:
    """A scorer's model as the manager reaches it: its HF directory (resolved) and its engines."""

    model: str
    urls: list[str]


@dataclass(frozen=True)
class ManagerSpec:
    """What the trainer tells the manager process it starts (``--spec``, a JSON file in the run directory)."""

    config: str  # the run's resolved config.yaml
    hf_dir: str  # the model's HF directory (tokenizer, config.json)
    urls: list[str]  # the engines
    orders: str  # ZMQ address the manager pulls orders from
    events: str  # ZMQ address it pushes events to
    cursor: int  # the next new prompt index
    reissue: list[int]  # prompts to issue before new ones (a resumed run's pending ones)
    # the scorers (moerl.orchestrator.config.scorers) by section: reward, teacher
    scorers: dict[str, ServedModel] = field(default_factory=dict)

    def write(self, path: Path) -> None:
        """Whole or not at all: the manager reads it as soon as it exists."""
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(asdict(self), indent=1))
        partial.replace(path)

    @classmethod
    def read(cls, path: str | Path) -> ManagerSpec:
        fields = json.loads(Path(path).read_text())
        fields["scorers"] = {key: ServedModel(**served) for key, served in fields.get("scorers", {}).items()}
        return cls(**fields)
