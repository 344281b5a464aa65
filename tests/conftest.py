from __future__ import annotations

import os
import shlex
import sys
from collections import Counter
from pathlib import Path

# What this pytest was asked on its command line, PYTEST_ADDOPTS with it (an xdist worker's own command line is
# xdist's: read in the process that starts the workers).
ARGS = sys.argv[1:] + shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))


def _marker_expression(args: list[str]) -> str:
    expr = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "-m"), None)
    return expr or next((a[2:] for a in args if a.startswith("-m") and len(a) > 2 and not a.startswith("--")), "")


def _gpu_tests_selected(args: list[str]) -> bool:
    expr = _marker_expression(args)
    return "gpu" in expr and "not gpu" not in expr


# `python3 -m pytest` is the CPU suite on every machine: CUDA is hidden from it, and from every process it
# starts, before anything asks torch about devices. `-m gpu` selects the CUDA tests and leaves the GPUs visible.
# An xdist worker (below) has its environment from the pytest process that started it; beside the other, it and the
# processes its tests start compute on one thread: more would only contend for the cores.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
elif not _gpu_tests_selected(ARGS):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

from moerl.models.tiny import ARCHITECTURES, save_tiny_hf  # noqa: E402

ARCHS = ARCHITECTURES


def pytest_xdist_auto_num_workers(config) -> int | None:
    """Two tests at a time, a file's on one worker (pytest.ini: ``-n auto --maxprocesses 2 --dist loadfile``); the
    `gpu` tests one at a time: each test's ranks take a GPU each."""
    return 0 if _gpu_tests_selected(ARGS) else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with the most end-to-end tests first, the others as collected: xdist hands its workers a file at a
    time in this order (pytest.ini's ``--no-loadscope-reorder``), so that the longest start first and the unit files
    even out the end."""
    e2e = Counter(item.path for item in items if item.get_closest_marker("e2e"))
    items.sort(key=lambda item: -e2e[item.path])  # stable: each file's tests stay together, in their order


def pytest_collection_finish(session) -> None:
    """Multi-rank tests fork their CPU ranks from multiprocessing's fork server, which imports megatron-core once: start
    it now, before an in-process test's generation workers start it without those imports."""
    if any(item.get_closest_marker("e2e") for item in session.items):
        from moerl.megatron.launch import start_fork_server

        start_fork_server(["tests.workers"])


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The interpreter SGLang servers run with (:func:`moerl.engines.sglang.server_python`). Without a usable SGLang
    (``bash tools/install.sh sglang``) the test is skipped, saying why; where ``MOERL_REQUIRE_SGLANG`` is set (CI) it
    fails instead, so the sglang tier never skips unseen."""
    from moerl.engines.sglang import server_python, sglang_problem

    if problem := sglang_problem():
        if os.environ.get("MOERL_REQUIRE_SGLANG"):
            pytest.fail(f"MOERL_REQUIRE_SGLANG is set and {problem}")
        pytest.skip(problem)
    python = server_python()
    assert python is not None, "sglang_problem found an interpreter"
    return python


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> dict:
    """arch -> (hf_dir, mcore_dir) of a tiny random model and its converted Megatron checkpoint.

    Qwen3 is saved in several shards with an index, Qwen2 (tied embeddings, shared experts) as a
    single file, so both HF layouts are read.
    """
    from moerl.checkpoint.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHS:
        hf_dir = save_tiny_hf(arch, root / f"{arch}-hf", max_shard_size="100KB" if arch.startswith("Qwen3") else None)
        out[arch] = (hf_dir, hf_to_mcore(hf_dir, root / f"{arch}-mcore", progress=False))
    return out


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A directory of this run that every xdist worker shares (pytest.ini's -n): the base of the workers' own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture(scope="session")
def demo_cache(shared_dir):
    """A ``run.cache_dir`` for the run's jobs, on every worker: the CPU demo's models (its warmed-up policy, its reward
    model) are made in it once, by the first job or fixture that needs each, and each model converted to the Megatron
    layout once (:mod:`moerl.orchestrator.model_cache`; a job that needs one being made waits for it)."""
    cache = shared_dir / "moerl-cache"
    cache.mkdir(exist_ok=True)
    return cache


@pytest.fixture(scope="session")
def demo_model(demo_cache):
    """The CPU demo's warmed-up tiny policy (HF directory) in :func:`demo_cache`, as a run without model.path gets it,
    converted there too."""
    from moerl.orchestrator.config import load_config
    from moerl.orchestrator.model_cache import prepare_model

    hf, _ = prepare_model(load_config(None, [f"run.cache_dir={demo_cache}"]))
    return hf


@pytest.fixture(scope="session")
def demo_reward_model(demo_cache):
    """The CPU demo's reward model (``reward.model=demo``; HF directory) in :func:`demo_cache`."""
    from moerl.orchestrator.config import load_config, scorers
    from moerl.orchestrator.model_cache import prepare_scorer_model

    cfg = load_config(None, ["reward.model=demo", f"run.cache_dir={demo_cache}"])
    return prepare_scorer_model(cfg, scorers(cfg)[0])


@pytest.fixture(scope="session")
def calc_model(shared_dir):
    """A tiny Qwen3-MoE warmed up briefly on the calc task's tool format: it writes well-formed tool calls and ends its
    turns, though it uses the tool less often and less well than the demo's (what the episode tests need)."""
    from moerl.files import build_once
    from moerl.tasks.calc import save_warm_calc_model

    return build_once(shared_dir / "calc", lambda staging: save_warm_calc_model(staging / "model", steps=80)) / "model"


def hub_grads(hf_model) -> dict[str, torch.Tensor]:
    """Gradients of a transformers model under the Hub's per-expert names.

    transformers 5 keeps experts fused in memory (``experts.gate_up_proj`` [E, 2F, H],
    ``experts.down_proj`` [E, H, F]) but the Hub, and so moerl's mapping, names them per expert.
    """
    grads = {}
    for name, p in hf_model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, (gate, up) in enumerate(zip(*g.chunk(2, dim=1), strict=True)):
                grads[f"{prefix}{e}.gate_proj.weight"] = gate
                grads[f"{prefix}{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                grads[f"{prefix}{e}.down_proj.weight"] = g[e]
        else:
            grads[name] = g
    return grads


def assert_hf_grads(grads: dict[str, torch.Tensor], hf_model) -> None:
    """Megatron-named ``grads`` (a trainer's step) are ``hf_model``'s own gradients, mapped by moerl's TensorRules."""
    from moerl.models import family_for

    family = family_for(hf_model.config.to_dict())
    cfg = family.normalize(hf_model.config.to_dict())
    hub = hub_grads(hf_model)
    expected = {r.mcore: family.to_mcore(r, [hub[n] for n in r.hf], cfg) for r in family.all_rules(cfg)}
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert (grads[name] - g).norm() <= 1e-4 * g.norm() + 1e-7, name
