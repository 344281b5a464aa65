"""``python -m moerl.cli.rollout_manager --spec FILE``: the rollout manager's process, started by the main job."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path

SPEC_POLL_S = 0.02


def configure_logging() -> None:
    """moerl's own INFO lines; other libraries' warnings only (an agent's HTTP client logs each request at INFO)."""
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("moerl").setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    from moerl.orchestrator.config import load_config
    from moerl.orchestrator.manager import RolloutManager
    from moerl.orchestrator.messages import ManagerSpec

    p = argparse.ArgumentParser(
        prog="python -m moerl.cli.rollout_manager", description="Rollout manager (started by the main job)."
    )
    p.add_argument(
        "--spec",
        required=True,
        help="JSON the trainer writes once the engines are up (config, engines, sockets, data position): waited for",
    )
    args = p.parse_args(argv)
    configure_logging()
    while not Path(args.spec).exists():  # the job started this process early, for its imports (it dies with rank 0)
        time.sleep(SPEC_POLL_S)
    spec = ManagerSpec.read(args.spec)
    manager = RolloutManager(load_config(spec.config, []), spec)
    asyncio.run(manager.run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
