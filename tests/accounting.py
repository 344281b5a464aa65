"""Reading a run's accounting.json, and what an async run may leave at its stop."""

import json
from pathlib import Path

# An async run orders ahead of its steps: at the stop those groups are ready, or still generating (or being scored).
LEFT_AT_STOP = {"unused_at_stop", "in_flight_at_stop"}


def accounting(run_dir: Path) -> dict:
    return json.loads((run_dir / "accounting.json").read_text())


def assert_async_run_accounted(acct: dict, trained: int, depth: int) -> None:
    """Every prompt accounted for, ``trained`` of them trained, and nothing dropped but the groups an async run had
    ordered ahead when it stopped, at most its depth (rollout.max_outstanding_groups's default, groups_per_step x
    max(1, max_staleness)), and those a fault held past the staleness window, at most that depth again: a group in
    flight when a replica died or went silent ends after groups ordered later, which its step may take instead."""
    assert acct["balanced"] and acct["live"] == 0 and acct["trained"] == trained, acct
    dropped = acct["dropped"]
    assert set(dropped) <= LEFT_AT_STOP | {"stale"} and dropped.get("stale", 0) <= depth, acct
    assert sum(dropped.get(reason, 0) for reason in LEFT_AT_STOP) <= depth, acct
