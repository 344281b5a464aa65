"""run_ranks' ranks start as spawned ones would, wherever they are forked from; a rank that initialises its parallel
state again leaves nothing of the last behind."""

from __future__ import annotations

import pytest

from moerl.megatron.launch import run_ranks
from tests.workers import transport_threads_over_initialisations, what_a_rank_sees


@pytest.mark.e2e
def test_ranks_write_to_the_launchers_output_and_see_its_environment_and_directory_as_they_are_now(
    capfd, monkeypatch, tmp_path
):
    """Forked from a fork server started earlier (by an earlier launch, or the test session), a rank would otherwise
    have the server's output, environment and directory, from when it started."""
    run_ranks(what_a_rank_sees, 1, "warm-up")  # the fork server runs from here on
    capfd.readouterr()
    monkeypatch.setenv("MOERL_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    assert run_ranks(what_a_rank_sees, 2, "now") == [("set after the server started", str(tmp_path))] * 2
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["stdout of rank 0: now", "stdout of rank 1: now"]
    assert sorted(line for line in err.splitlines() if line.startswith("stderr of")) == [
        "stderr of rank 0: now",
        "stderr of rank 1: now",
    ]


@pytest.mark.e2e
def test_parallel_state_initialised_again_destroys_the_last_ones_groups():
    """megatron-core's destroy_model_parallel forgets most of its groups without destroying them: each initialisation
    in one process (the tests', a converter called twice) would leave 17 gloo groups and their polling threads."""
    counts = run_ranks(transport_threads_over_initialisations, 1, 3)[0]
    assert counts[0] > 0 and counts == [counts[0]] * 3, counts
