"""The ``moerl`` command: ``moerl serve`` (embedded engine), ``engines`` (SGLang replicas), ``convert-ckpt``,
``train`` (one rank of the job), ``plot``."""

from __future__ import annotations

import os
import sys

COMMANDS = {
    "serve": (
        "moerl.engines.serve",
        "serve a HF MoE model over SGLang's HTTP API (embedded engine, or a simulated one)",
    ),
    "engines": ("moerl.engines.pool", "start SGLang replicas on this node for a job whose trainer runs elsewhere"),
    "convert-ckpt": ("moerl.checkpoint.cli", "convert checkpoints between HF and Megatron layouts"),
    "train": (
        "moerl.orchestrator.main",
        "the GRPO job on one rank (launched by recipes/qwen_moe_grpo.sh via torchrun)",
    ),
    "plot": ("moerl.orchestrator.metrics", "plot a run's metrics.jsonl as PNG curves"),
    "ablate": (
        "moerl.orchestrator.ablate",
        "run the main job under a grid of overrides; a comparison table and overlaid curves",
    ),
    "check-replay": (
        "moerl.trainer.replay_trace",
        "verify a run's replay trace: every router used the rollout's experts",
    ),
}


def main(argv: list[str] | None = None) -> int:
    from moerl.env import skip_the_last_collection

    skip_the_last_collection()  # its caller waits for it to end: a rank's launcher, an engine's pool
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<14}{help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: moerl COMMAND [ARGS]  (moerl COMMAND --help for its options)\n\ncommands:\n" + "\n".join(lines))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "train" and "LOCAL_RANK" in os.environ:  # a launcher's rank (torchrun's, or a cluster's)
        from moerl.env import end_with_launcher

        end_with_launcher()  # before the slow imports: a launcher gone during them is seen too
    import importlib

    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
