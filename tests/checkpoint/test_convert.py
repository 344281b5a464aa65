"""HF <-> Megatron conversion: exact round trips and clear refusals of bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from moerl.checkpoint import convert
from moerl.checkpoint.convert import hf_to_mcore, mcore_to_hf
from moerl.checkpoint.hf import CheckpointError, HFReader
from moerl.cli.convert_ckpt import main as cli
from moerl.errors import ConfigError
from moerl.models.tiny import save_tiny_hf
from tests.conftest import ARCHS


def _leftovers(out: Path) -> list[Path]:
    return [p for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}.partial")]


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bitwise(arch, tiny_ckpts, tmp_path):
    hf_dir, mcore_dir = tiny_ckpts[arch]
    back = mcore_to_hf(mcore_dir, tmp_path / "back", progress=False, max_shard_bytes=200_000)

    original, restored = HFReader(hf_dir), HFReader(back)
    assert restored.names() == original.names()
    assert len(set(restored.file_of.values())) > 1, "expected a sharded output with an index"
    for name in original.names():
        assert torch.equal(original.get(name), restored.get(name)), name
    for carried in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (back / carried).read_bytes() == (hf_dir / carried).read_bytes(), carried

    # transformers loads the result and computes the same logits.
    ids = torch.arange(20).unsqueeze(0)
    a = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    b = AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_dense_interleaving_and_shared_experts_are_covered(tiny_ckpts):
    """The tiny models exercise what the round trip must carry: dense layers between MoE layers
    (Qwen3 mlp_only_layers, Qwen2 decoder_sparse_step) and Qwen2's gated shared expert."""
    q3 = HFReader(tiny_ckpts["Qwen3MoeForCausalLM"][0]).names()
    q2 = HFReader(tiny_ckpts["Qwen2MoeForCausalLM"][0]).names()
    assert "model.layers.1.mlp.gate_proj.weight" in q3 and "model.layers.0.mlp.gate.weight" in q3
    assert "model.layers.0.mlp.gate_proj.weight" in q2 and "model.layers.1.mlp.shared_expert_gate.weight" in q2


def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path):
    hf = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "hf")
    state = load_file(hf / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, hf / "model.safetensors", metadata={"format": "pt"})
    back = mcore_to_hf(hf_to_mcore(hf, tmp_path / "mc", progress=False), tmp_path / "back", progress=False)
    restored = HFReader(back)
    for name, tensor in state.items():
        assert torch.equal(restored.get(name), tensor.to(torch.bfloat16)), name


# ---- bad input --------------------------------------------------------------------------------


@pytest.fixture
def hf_copy(tiny_ckpts, tmp_path):
    src = tiny_ckpts["Qwen2MoeForCausalLM"][0]
    dst = tmp_path / "hf"
    shutil.copytree(src, dst)
    return dst


def _edit_config(hf_dir: Path, **changes):
    cfg = json.loads((hf_dir / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (hf_dir / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(hf_dir: Path, fn):
    state = load_file(hf_dir / "model.safetensors")
    fn(state)
    save_file(state, hf_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_experts=None), "missing required keys: num_experts"),
        (
            dict(quantization_config={"quant_method": "fp8"}),
            "unsupported keys (they may change the math): quantization_config",
        ),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "only plain RoPE"),
        (dict(use_sliding_window=True), "sliding-window attention is not supported"),
        (dict(architectures=["LlamaForCausalLM"]), "moerl supports"),
        (dict(mlp_only_layers=[9]), "mlp_only_layers has layers outside the model"),
    ],
)
def test_bad_config_is_refused_with_its_reason(hf_copy, tmp_path, changes, message):
    _edit_config(hf_copy, **changes)
    with pytest.raises(ConfigError, match=_literal(message)):
        hf_to_mcore(hf_copy, tmp_path / "out", progress=False)
    assert _leftovers(tmp_path / "out") == []


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda s: s.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
            "tensors missing, e.g. ['model.layers.1.mlp.experts.3.up_proj.weight']",
        ),
        (
            lambda s: s.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 64)}),
            "model.layers.0.self_attn.q_proj.weight: (3, 64) != expected (64, 64)",
        ),
        (
            lambda s: s.update({"model.layers.0.mlp.mystery.weight": torch.zeros(2)}),
            "tensors the model does not use, e.g. ['model.layers.0.mlp.mystery.weight']",
        ),
    ],
)
def test_bad_tensors_are_refused_by_name(hf_copy, tmp_path, edit, message):
    _edit_tensors(hf_copy, edit)
    with pytest.raises(CheckpointError, match=_literal(message)):
        hf_to_mcore(hf_copy, tmp_path / "out", progress=False)
    assert _leftovers(tmp_path / "out") == []


def test_existing_output_directory_is_refused(hf_copy, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        hf_to_mcore(hf_copy, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_failure_mid_conversion_leaves_nothing(hf_copy, tmp_path, monkeypatch):
    calls = []
    real_save = convert.save_sharded

    def failing_save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(convert, "save_sharded", failing_save)
    with pytest.raises(OSError, match="disk full"):
        hf_to_mcore(hf_copy, tmp_path / "out", progress=False)
    assert _leftovers(tmp_path / "out") == []


def test_cli_reports_user_errors_in_one_line(hf_copy, tmp_path, capsys):
    _edit_config(hf_copy, hidden_act="relu")
    assert cli(["hf-to-mcore", "--hf", str(hf_copy), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: Qwen2MoeForCausalLM config not supported: hidden_act='relu'")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ep", "3"], "num_experts=8 not divisible by EP=3"),
        (["--tp", "3"], "num_attention_heads=4 not divisible by TP=3"),
        (["--pp", "3"], "num_hidden_layers=4 not divisible by PP=3"),
    ],
)
def test_cli_verify_refuses_layouts_that_do_not_divide(tiny_ckpts, flags, message, capsys):
    hf_dir, mcore_dir = tiny_ckpts["Qwen3MoeForCausalLM"]
    assert cli(["verify", "--hf", str(hf_dir), "--mcore", str(mcore_dir), *flags]) == 2
    assert message in capsys.readouterr().err


def test_mcore_to_hf_refuses_a_directory_that_is_not_a_moerl_checkpoint(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(CheckpointError, match="not a moerl Megatron checkpoint"):
        mcore_to_hf(tmp_path / "x", tmp_path / "out", progress=False)


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def test_cli_verify_passes_a_faithful_conversion_at_tp2_ep2(tiny_ckpts, capsys):
    hf_dir, mcore_dir = tiny_ckpts["Qwen2MoeForCausalLM"]
    assert cli(["verify", "--hf", str(hf_dir), "--mcore", str(mcore_dir), "--tp", "2", "--ep", "2"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("verify TP2 PP1 EP2 ETP1: max |logit diff| = ") and "(OK," in line
    assert float(line.split("= ")[1].split()[0]) <= 1e-4


def test_cli_verify_fails_when_the_weights_differ(tiny_ckpts, tmp_path, capsys):
    _, mcore_dir = tiny_ckpts["Qwen3MoeForCausalLM"]
    other = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "other", seed=1)
    assert cli(["verify", "--hf", str(other), "--mcore", str(mcore_dir)]) == 1
    assert "(FAIL, tolerance 1.0e-03)" in capsys.readouterr().out


@pytest.mark.e2e
def test_what_a_save_forks_dies_with_the_saver_and_its_queue_server_watches_it(tmp_path, monkeypatch):
    """megatron-core forks checkpoint writers in each save and serves their results queue from a Manager it keeps: both
    must end with the rank that saves (a SIGKILLed rank left them behind). A child forked during save_sharded has
    SIGKILL as its parent-death signal, one forked outside it has none, and the queue's server of a process that is
    SIGKILLed after a save ends within seconds."""
    import ctypes
    import os
    import signal

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from moerl.checkpoint import mcore

    def death_signal_of_a_child() -> int:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own parent-death signal, through the pipe
            sig = ctypes.c_int(-1)
            ctypes.CDLL(None).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
            os.write(write, sig.value.to_bytes(4, "little", signed=True))
            os._exit(0)
        os.close(write)
        value = int.from_bytes(os.read(read, 4), "little", signed=True)
        os.close(read)
        os.waitpid(pid, 0)
        return value

    seen = []
    monkeypatch.setattr(
        mcore.dist_checkpointing, "save", lambda *args, **kwargs: seen.append(death_signal_of_a_child())
    )
    # started already
    monkeypatch.setattr(filesystem_async, "_results_queue", filesystem_async._results_queue or object())
    mcore.save_sharded({}, tmp_path)
    assert seen == [signal.SIGKILL] and death_signal_of_a_child() == 0

    saver = subprocess.run(
        [
            sys.executable,
            "-c",
            f"""
import os, sys
from megatron.core.dist_checkpointing.strategies import filesystem_async
from moerl.checkpoint import mcore
mcore.dist_checkpointing.save = lambda *args, **kwargs: None
mcore.save_sharded({{}}, {str(tmp_path)!r})
open({str(tmp_path / "server")!r}, "w").write(str(filesystem_async._results_queue._manager._process.pid))
os.kill(os.getpid(), 9)
""",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=300,
    )  # no pipe: the server would hold it open
    assert saver.returncode == -signal.SIGKILL
    server, deadline = int((tmp_path / "server").read_text()), time.monotonic() + 10
    while _running(server):
        if time.monotonic() > deadline:
            os.kill(server, signal.SIGKILL)
            pytest.fail("the checkpoint queue's server outlived its SIGKILLed saver")
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
