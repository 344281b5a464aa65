"""A run's checkpoints: the trainer's (collective) and, beside it, the run state global rank 0 writes (the data position
and every prompt not yet trained, to be issued again), which marks the checkpoint complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from moerl.megatron.parallel import on_lead

if TYPE_CHECKING:
    from moerl.orchestrator.rollouts import RolloutBuffer
    from moerl.trainer.protocol import TrainerLike

RUN_STATE = "run_state.json"
# A file in run.dir that asks the run to checkpoint at its next safe point and stop (a scheduler's warning of
# preemption, or a user's): between two steps, or while a step waits for groups.
STOP_REQUEST = "stop_requested"


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = [d for d in (run_dir / "checkpoints").glob("step_*") if (d / RUN_STATE).is_file()]
    return max(done, key=lambda d: int(d.name.split("_")[1])) if done else None


def save_checkpoint(trainer: TrainerLike, rollouts: RolloutBuffer | None, run_dir: Path) -> None:
    """The trainer (collective) and, from rank 0, the data position and every live prompt to re-issue."""
    out = run_dir / "checkpoints" / f"step_{trainer.version}"
    # the same version saved already (a stop in the step after it): its state is new
    complete = (out / RUN_STATE).is_file()
    if not complete:
        # A previous attempt at this step that never finished.
        on_lead(lambda: shutil.rmtree(out) if out.exists() else None, f"removing the unfinished checkpoint {out}")
        trainer.save(out)

    def run_state() -> None:
        assert rollouts is not None, "rank 0 holds the rollouts"
        rollouts.drain()
        state = {
            "step": trainer.version,
            "cursor": rollouts.cursor,
            "pending": rollouts.pending(),
            "accounting": rollouts.acct.state(),
        }
        partial = out / f".{RUN_STATE}.partial"
        partial.write_text(json.dumps(state, indent=1))
        partial.replace(out / RUN_STATE)  # whole or not at all: it marks the checkpoint complete

    on_lead(run_state, f"writing the run state of checkpoint {out}")
