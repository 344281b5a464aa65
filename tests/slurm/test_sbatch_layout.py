"""recipes/slurm/moerl.sbatch's layout (recipes/slurm/job.py) for a GPU recipe, without a cluster."""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from moerl.orchestrator.config import load_config, to_yaml
from tests import REPO

spec = importlib.util.spec_from_file_location("slurm_job", REPO / "recipes" / "slurm" / "job.py")
assert spec is not None and spec.loader is not None
job = importlib.util.module_from_spec(spec)
spec.loader.exec_module(job)


def test_the_30b_recipe_takes_two_trainer_nodes_and_one_engine_node_of_eight_gpus(monkeypatch):
    """16 ranks at TP2 x EP8 on two nodes of 8 GPUs; 4 SGLang replicas of TP2 on the third (as its header says), and a
    two-node allocation refused naming the three it needs."""
    config = load_config(REPO / "recipes" / "qwen3_30b_a3b.yaml", ["model.path=/models/Qwen3-30B-A3B"])
    cfg = yaml.safe_load(to_yaml(config))  # what `moerl train --show-config` prints
    assert job.layout(cfg, 8, 3) == {"trainer_nodes": 2, "ranks_per_node": 8, "engine_nodes": 1, "replicas_per_node": 4}
    assert job.engine_args(cfg, 8, 4) == [
        "--model", "/models/Qwen3-30B-A3B", "--server", "sglang", "--replicas", "4", "--gpus-per-replica", "2",
        "--dtype", "auto", "--mem-fraction-static", "0.8",
    ]  # fmt: skip
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[1-2]")
    with pytest.raises(job.LayoutError) as refused:
        job.layout(cfg, 8, 2)
    assert str(refused.value) == (
        "the config needs 3 node(s): 2 trainer node(s) for 16 rank(s) + 1 engine node(s) for 4 replica(s) of 2 GPU(s) "
        "(8 GPUs a node); the allocation has 2 (gpu[1-2]): sbatch -N 3"
    )
