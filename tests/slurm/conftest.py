from __future__ import annotations

import os

import pytest

from tests.slurm_cluster import Cluster, unavailable


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A local Slurm cluster of three nodes (:class:`tests.slurm_cluster.Cluster`), up for the module's tests. Where
    Slurm, munge or network namespaces are missing the test is skipped, saying why; where ``MOERL_REQUIRE_SLURM`` is
    set (CI) it fails instead."""
    if problem := unavailable():
        if os.environ.get("MOERL_REQUIRE_SLURM"):
            pytest.fail(f"MOERL_REQUIRE_SLURM is set and {problem}")
        pytest.skip(f"no local Slurm cluster here: {problem}")
    with Cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
