"""The ``moerl`` command: ``moerl serve`` (embedded engine), ``engines`` (SGLang replicas), ``convert-ckpt``,
``train`` (one rank of the job), ``plot``, ``ablate``, ``check-replay``, ``tiny-model``. Each command is the module
``moerl.cli.<command>`` (dashes as underscores), imported only to run it; the library code it calls stays in its
package."""

from __future__ import annotations

import os
import sys

COMMANDS = {
    "serve": "serve a HF MoE model over SGLang's HTTP API (embedded engine, or a simulated one)",
    "engines": "start SGLang replicas on this node for a job whose trainer runs elsewhere",
    "convert-ckpt": "convert checkpoints between HF and Megatron layouts",
    "train": "the GRPO job on one rank (launched by recipes/qwen_moe_grpo.sh via torchrun)",
    "plot": "plot a run's metrics.jsonl as PNG curves",
    "ablate": "run the main job under a grid of overrides; a comparison table and overlaid curves",
    "check-replay": "verify a run's replay trace: every router used the rollout's experts",
    "calibrate-lengths": "fit a simulation profile's response lengths to runs' own",
    "tiny-model": "write a tiny random Qwen MoE model, for demos and tests where no model can be downloaded",
}


def main(argv: list[str] | None = None) -> int:
    from moerl.env import skip_the_last_collection

    skip_the_last_collection()  # its caller waits for it to end: a rank's launcher, an engine's pool
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<14}{help_}" for name, help_ in COMMANDS.items()]
        print("usage: moerl COMMAND [ARGS]  (moerl COMMAND --help for its options)\n\ncommands:\n" + "\n".join(lines))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "train" and "LOCAL_RANK" in os.environ:  # a launcher's rank (torchrun's, or a cluster's)
        from moerl.env import end_with_launcher

        end_with_launcher()  # before the slow imports: a launcher gone during them is seen too
    import importlib

    return importlib.import_module(f"moerl.cli.{argv[0].replace('-', '_')}").main(argv[1:])
