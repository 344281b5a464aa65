"""``moerl check-replay``: verify a run's replay trace (:mod:`moerl.trainer.replay_trace`)."""

from __future__ import annotations

import argparse

from moerl.trainer.replay_trace import TraceError, check_replay


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="moerl check-replay",
        description=(
            "Verify a run's replay trace (trainer.replay.trace_samples > 0): under R3 every router of every traced "
            "sample used the rollout's experts at every layer and position, in the old-policy pass, the training "
            "forward and any recompute; under R2 the training pass used the old-policy pass's. Exit 1 and list where "
            "not."
        ),
    )
    p.add_argument("run_dir", help="the run directory (or its replay_trace/)")
    p.add_argument("--show", type=int, default=20, help="mismatches to list")
    args = p.parse_args(argv)
    try:
        report = check_replay(args.run_dir)
    except TraceError as e:
        print(f"error: {e}")
        return 2
    print(report.summary(args.show))
    return 0 if report.ok else 1
