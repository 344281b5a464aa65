"""sync.verify with FP8 engines: the reference is the log-probs an FP8 engine computes from exactly the pushed tensors
(moerl.weight_sync.fp8_probe), streamed a weight layer at a time, so an FP8 engine holding the push matches it to fp32's
rounding and one holding another policy does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moerl.checkpoint.hf import HFReader, read_config, save_fp8
from moerl.engines.embedded.engine import EmbeddedEngine
from moerl.fp8 import quantize_named
from moerl.models import family_for
from moerl.models.tiny import ARCHITECTURES, save_tiny_hf
from moerl.weight_sync.base import probe_ids
from moerl.weight_sync.fp8_probe import fp8_logprobs
from tests.engines.test_fp8_engine import prompt_pass, serving


def pushed_layers(hf_dir):
    """The HF directory's tensors as an FP8 push sends them, a weight layer at a time in the order a forward needs
    them; and how many of them were read at once, at most."""
    config = read_config(hf_dir)
    family = family_for(config)
    reader = HFReader(hf_dir)
    held = {"layers": 0}

    def layers():
        for _, rules in family.weight_layers(family.normalize(config)):
            held["layers"] += 1
            yield list(quantize_named([(name, reader.get(name)) for rule in rules for name in rule.hf]))

    return layers(), held


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_streamed_fp8_reference_is_what_the_embedded_fp8_engine_computes(tmp_path, arch, dtype):
    src = save_tiny_hf(arch, tmp_path / "hf")
    config = read_config(src)
    ids = probe_ids(config["vocab_size"])
    layers, held = pushed_layers(src)
    ours = fp8_logprobs(config, ids, dtype, "cpu", layers)
    assert ours.dtype == torch.float32 and ours.shape == (len(ids) - 1,)
    assert held["layers"] == config["num_hidden_layers"] + 1  # each read once, as the forward reached it
    with serving(EmbeddedEngine(str(save_fp8(src, tmp_path / "fp8")), dtype=dtype, device="cpu")) as engine:
        theirs, _ = prompt_pass(engine, ids)
    np.testing.assert_allclose(ours.double().numpy(), theirs, rtol=0, atol=1e-5)
    # the unquantized model's differ by far more: the reference is FP8's
    with serving(EmbeddedEngine(str(src), dtype=dtype, device="cpu")) as engine:
        plain, _ = prompt_pass(engine, ids)
    assert np.abs(plain - ours.double().numpy()).mean() > 1e-3


def test_a_layer_of_the_wrong_model_is_refused(tmp_path):
    src = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "hf")
    config = read_config(src)
    layers, _ = pushed_layers(src)
    first = next(layers)
    with pytest.raises(RuntimeError, match="decoder layer 0"):
        fp8_logprobs(config, probe_ids(config["vocab_size"]), torch.float32, "cpu", iter([first, first]))


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["broadcast", "tensor"])  # a delta push verifies as a tensor push: a whole gather
def test_verify_passes_fp8_engines_holding_the_push_at_fp32_tolerance_and_fails_a_stale_one(
    tiny_ckpts, tmp_path, strategy
):
    from moerl.engines.pool import EnginePool, EnginePoolConfig
    from moerl.megatron.launch import run_ranks
    from moerl.trainer.config import OptimConfig, TrainerConfig
    from tests.trainer.test_trainer import rollout
    from tests.workers import verify_fp8_engines

    hf_dir, mcore_dir = tiny_ckpts["Qwen3MoeForCausalLM"]
    samples = rollout(hf_dir, torch.float32)
    cfg = TrainerConfig(optim=OptimConfig(lr=1e-2), ep=2)
    engines = EnginePoolConfig(
        model_path=str(save_fp8(hf_dir, tmp_path / "fp8")),
        server="embedded",
        base_port=0,
        dtype="float32",
        replicas=2,
        log_dir=str(tmp_path),
    )
    with EnginePool(engines) as pool:
        ranks = run_ranks(verify_fp8_engines, 2, str(mcore_dir), cfg, samples, pool.urls, strategy)
    out = ranks[0]
    assert out["worst"]["sync/verify_mean_abs_delta"] < 1e-5
    assert out["worst"]["sync/verify_max_abs_delta"] < 1e-4
    # every rank has the reference; the trainer's own unquantized forward is far outside fp32's tolerance
    assert np.array_equal(ranks[1]["reference"], out["reference"])
    assert np.abs(out["plain"] - out["reference"]).mean() > 1e-3
    kind, message = out["stale"]
    assert kind == "WeightSyncError" and "log-probs of the probe differ" in message, message
    assert ranks[1]["stale"] is not None  # every rank stops with it
