"""What moerl needs to know of SGLang itself: where its servers' interpreter is, whether that one runs a release whose
API moerl's wire contract speaks, how a server starts on a machine without a GPU, which models it would serve wrong,
and which modules a LoRA server must serve. Starting servers is :mod:`moerl.engines.pool`'s.

SGLang runs in an environment of its own (``bash tools/install.sh sglang`` makes it): its pins (torch, transformers,
openai and many more) are not the trainer's, and on a CPU it needs a CUDA build of torch that the trainer does not.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from moerl.engines.protocol import SGLANG_VERSION

# What SGLang 0.5.23 needs on the CPU besides its own package: the stand-in for two sgl-kernel operators and the
# diversions of three GPU calls (read each module's docstring), put on the server's PYTHONPATH.
CPU_SUPPORT = Path(__file__).resolve().parent / "sglang_cpu"
# KV-cache tokens of a CPU server when none are configured: SGLang would size its cache from the host's free memory
# (13.7 GB and 41 s on a 24 GB machine).
CPU_KV_TOKENS = 16384


def environment() -> Path:
    """The environment ``tools/install.sh sglang`` installs SGLang into: ``MOERL_SGLANG_VENV``, else one per release
    under ``~/.cache/moerl``."""
    return Path(os.environ.get("MOERL_SGLANG_VENV") or f"~/.cache/moerl/sglang-{SGLANG_VERSION}").expanduser()


def server_python() -> str | None:
    """The interpreter SGLang servers run with: ``MOERL_SGLANG_PYTHON``; else that of :func:`environment` where it
    exists; else this one, where sglang is installed beside moerl. None: none of them."""
    if given := os.environ.get("MOERL_SGLANG_PYTHON"):
        return given
    python = environment() / "bin" / "python"
    if python.exists():
        return str(python)
    from importlib.util import find_spec

    return sys.executable if find_spec("sglang") is not None else None


@functools.cache
def _version_in(python: str) -> str | None:
    """The sglang release installed for ``python`` (None: none, or no such interpreter)."""
    try:
        out = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def sglang_problem(installed: str | None = None) -> str | None:
    """Why SGLang servers cannot be used here (None: they can): not installed, or older than the release whose API
    moerl speaks (weight-update sessions, sampling masks, triton_v2 LoRA). ``installed``: a version reported by a
    running server instead of this machine's."""
    from packaging.version import InvalidVersion, Version

    if installed is None:
        python = server_python()
        installed = _version_in(python) if python is not None else None
        if installed is None:
            where = f" for {python}" if python is not None else ""
            return f"sglang is not installed{where} (bash tools/install.sh sglang installs {SGLANG_VERSION})"
    try:
        too_old = Version(installed) < Version(SGLANG_VERSION)
    except InvalidVersion:
        return f"sglang version {installed!r} is not a version number"
    return f"sglang {installed} is older than {SGLANG_VERSION}, whose HTTP API moerl speaks" if too_old else None


def server_env(cuda: bool) -> dict[str, str]:
    """The environment variables an SGLang server starts with: on its PYTHONPATH moerl itself (for moerl's weight
    loader, :data:`~moerl.engines.delta.LOAD_FORMAT`) and on the CPU moerl's CPU support ahead of it, with SGLang's CPU
    engine and without its crash diagnostics (a py-spy and CUDA core dump of its schedulers, after 5 s "to let GPU
    activity settle", which it takes each stop for a crash)."""
    paths = [str(moerl_alone()), os.environ.get("PYTHONPATH", "")]
    if cuda:
        return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
        "PYTHONPATH": os.pathsep.join(p for p in [str(CPU_SUPPORT), *paths] if p),
    }


def moerl_alone() -> Path:
    """A directory holding nothing but a link to this moerl package, for an SGLang server's PYTHONPATH: moerl's own
    parent may be this environment's site-packages, whose torch would shadow the server's."""
    package = Path(__file__).resolve().parents[1]
    home = environment().parent / f"moerl-path-{hashlib.sha1(str(package).encode()).hexdigest()[:12]}"
    link = home / "moerl"
    if not (link.is_symlink() and link.resolve() == package):
        home.mkdir(parents=True, exist_ok=True)
        staged = home / f".moerl-{os.getpid()}"
        staged.unlink(missing_ok=True)
        staged.symlink_to(package, target_is_directory=True)
        staged.replace(link)  # atomic: a server starting meanwhile sees the old link or the new one
    return home


def cpu_args(kv_tokens: int | None) -> list[str]:
    """SGLang's flags for serving on the CPU: torch's own attention, no CUDA graphs, a KV cache of ``kv_tokens``
    (None: :data:`CPU_KV_TOKENS`), and a scheduler that sleeps while idle instead of spinning a core."""
    return [
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--disable-cuda-graph",
        "--max-total-tokens",
        str(kv_tokens or CPU_KV_TOKENS),
        "--sleep-on-idle",
    ]


def served_wrong(model_dir: str | Path) -> str | None:
    """Why SGLang 0.5.23 would serve the model at ``model_dir`` wrong (None: it serves it as transformers computes it),
    found by comparing its logits and routing with transformers':

    - its Qwen2-MoE and Qwen3-MoE build every layer sparse, whatever ``mlp_only_layers`` and ``decoder_sparse_step``
      say: a dense layer's weights are dropped and its experts stay uninitialised;
    - they never tie the output layer to the embeddings: with ``tie_word_embeddings`` the checkpoint has no
      ``lm_head.weight``, and the output layer stays uninitialised;
    - its sequence classifiers' score head has a bias that transformers' lacks: a checkpoint without ``score.bias``
      leaves it random, and every score is off by that constant.
    """
    from moerl.checkpoint.hf import HFReader, read_config
    from moerl.models import FAMILIES, is_classifier

    raw = read_config(model_dir)
    architectures = raw.get("architectures") or []
    if any(a in FAMILIES for a in architectures):
        problems = []
        dense = raw.get("mlp_only_layers") or []
        if dense:
            problems.append(f"mlp_only_layers={dense}")
        if raw.get("decoder_sparse_step", 1) != 1:
            problems.append(f"decoder_sparse_step={raw['decoder_sparse_step']}")
        if problems:
            return (
                f"{model_dir} has dense layers ({', '.join(problems)}), which SGLang {SGLANG_VERSION} builds as MoE "
                "layers (their weights dropped, their experts uninitialised)"
            )
        if raw.get("tie_word_embeddings"):
            return (
                f"{model_dir} ties its output layer to its embeddings (tie_word_embeddings), which SGLang "
                f"{SGLANG_VERSION}'s {architectures[0]} does not: its output layer would stay uninitialised"
            )
    elif is_classifier(architectures) and architectures[0].endswith("ForSequenceClassification"):
        if "score.bias" not in HFReader(model_dir).names():
            return (
                f"{model_dir} has no score.bias, and SGLang {SGLANG_VERSION}'s {architectures[0]} adds a bias to the "
                "score head that transformers' lacks: it would stay random and shift every score; add a zero "
                "score.bias tensor of shape [num_labels] to the checkpoint (transformers ignores it)"
            )
    return None


def lora_target_modules(model_path: str | Path, targets: list[str]) -> list[str]:
    """A LoRA server's ``--lora-target-modules``: the Hub modules adapters of megatron ``targets`` (``lora.targets``)
    take in the model at ``model_path``, and the experts' always."""
    from moerl.checkpoint.hf import read_config
    from moerl.checkpoint.peft import hub_target_modules
    from moerl.megatron.lora_config import LoRAConfig
    from moerl.models import family_for

    raw = read_config(model_path)
    family = family_for(raw)
    modules = hub_target_modules(family, family.normalize(raw), LoRAConfig(targets=list(targets)))
    if not modules:
        raise ValueError(f"lora.targets={list(targets)} match no linear layer of {model_path}")
    # The LoRA MoE runner (lora_triton) refuses to start unless the routed experts take LoRA, which SGLang gives them
    # only when both gate_up_proj and down_proj are targets. An adapter may adapt fewer modules than its server serves.
    return sorted(set(modules) | {"gate_proj", "up_proj", "down_proj"})
