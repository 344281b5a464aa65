"""Megatron checkpoints load into a model of either spec: Transformer Engine's norms (TENorm) keep an extra state,
which megatron-core checkpoints and a TE-built model asks for, and which checkpoints before format 3 lack."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

from moerl.checkpoint import mcore
from moerl.checkpoint.convert import hf_to_mcore
from moerl.checkpoint.hf import HFReader
from moerl.megatron.launch import run_ranks
from moerl.models.norm import RMSNorm

ARCH = "Qwen3MoeForCausalLM"
Q_NORM = "decoder.layers.0.self_attention.q_layernorm"


def _load(mcore_dir: str) -> dict:
    """A checkpoint loaded as the weights of a model (``load_model_weights``) and as a resumed trainer loads it (nested
    under "model"): the first's tensors, what each norm's ``set_extra_state`` was given, and whether the second
    agrees."""
    from moerl.checkpoint.mcore import SHARDED_METADATA, load_megatron_model, load_sharded
    from moerl.layout import Layout

    _, model = load_megatron_model(mcore_dir, Layout())
    tensors = {n: t.clone() for n, t in model.state_dict().items() if not n.endswith("_extra_state")}
    norms = {n: m.given for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    resumed = load_sharded({"model": model.sharded_state_dict(metadata=SHARDED_METADATA)}, mcore_dir)["model"]
    model.load_state_dict(resumed, strict=True)
    same = all(torch.equal(t, model.state_dict()[n]) for n, t in tensors.items())
    return {"tensors": tensors, "norms": norms, "resumed_same": same}


def _recording(get_extra_state):
    def set_extra_state(self, state):
        self.given = state

    RMSNorm.get_extra_state, RMSNorm.set_extra_state = get_extra_state, set_extra_state
    RMSNorm.given = "nothing"


def load_each_way(mcore_dirs: list[str]) -> dict:
    """Each checkpoint loaded into moerl's norms, then into norms with TE's extra state: an op's pickled quantization
    state (none here), recorded where it is set."""
    out = {}
    _recording(RMSNorm.get_extra_state)
    for path in mcore_dirs:
        out[path, "moerl"] = _load(path)
    _recording(lambda self: torch.frombuffer(bytearray(pickle.dumps({})), dtype=torch.uint8))
    for path in mcore_dirs:
        out[path, "te"] = _load(path)
    return out


def load_with_a_norm_bias(mcore_dir: str) -> None:
    """A model whose norms have a bias, which no checkpoint holds."""
    from moerl.checkpoint.mcore import load_megatron_model
    from moerl.layout import Layout

    init = RMSNorm.__init__

    def with_bias(self, config, hidden_size, *args, **kwargs):
        init(self, config, hidden_size, *args, **kwargs)
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size))

    RMSNorm.__init__ = with_bias
    load_megatron_model(mcore_dir, Layout())


@pytest.fixture(scope="module")
def checkpoints(tiny_ckpts, tmp_path_factory) -> dict:
    """The tiny model's HF directory, its checkpoint in the current format, and one in format 2 (no norm extra
    state)."""
    hf_dir, current = tiny_ckpts[ARCH]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(RMSNorm, "get_extra_state", torch.nn.Module.get_extra_state)  # the module default: none saved
        old = hf_to_mcore(hf_dir, tmp_path_factory.mktemp("format2") / "mcore", progress=False)
    meta = old / mcore.MOERL_META
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "format_version": 2}))
    return {"hf": hf_dir, "current": current, "old": old}


@pytest.fixture(scope="module")
def loaded(checkpoints) -> dict:
    return run_ranks(load_each_way, 1, [str(checkpoints["current"]), str(checkpoints["old"])])[0]


def _norm_keys(ckpt) -> set[str]:
    return {item.key for item in load_sharded_metadata(str(ckpt)).values() if item.key.endswith("norm._extra_state")}


def test_checkpoints_hold_the_norms_extra_state_from_format_3(checkpoints):
    assert (
        json.loads((checkpoints["current"] / mcore.MOERL_META).read_text())["format_version"]
        == mcore.FORMAT_VERSION
        == 3
    )
    assert {f"{Q_NORM}._extra_state", "decoder.final_layernorm._extra_state"} <= _norm_keys(checkpoints["current"])
    assert _norm_keys(checkpoints["old"]) == set()


@pytest.mark.e2e
@pytest.mark.parametrize("ckpt", ["current", "old"])
@pytest.mark.parametrize("norm", ["moerl", "te"])
def test_a_checkpoint_of_either_format_loads_into_norms_of_either_spec(checkpoints, loaded, ckpt, norm):
    got = loaded[str(checkpoints[ckpt]), norm]
    reference = loaded[str(checkpoints["current"]), "moerl"]["tensors"]
    assert got["tensors"].keys() == reference.keys()
    for name, tensor in got["tensors"].items():
        assert torch.equal(tensor, reference[name]), name
    assert torch.equal(
        got["tensors"][f"{Q_NORM}.weight"], HFReader(checkpoints["hf"]).get("model.layers.0.self_attn.q_norm.weight")
    )
    assert got["resumed_same"]
    # Each norm is given the checkpoint's extra state where it holds one, else its own (TE's: a pickled empty dict).
    own = pickle.dumps({}) if norm == "te" else b""
    expected = b"" if ckpt == "current" else own
    assert got["norms"] and all(bytes(state.numpy()) == expected for state in got["norms"].values()), got["norms"]


@pytest.mark.e2e
def test_a_key_the_checkpoint_lacks_other_than_an_extra_state_still_fails(checkpoints):
    with pytest.raises(
        RuntimeError, match=r"decoder\.layers\.0\.self_attention\.(q_layernorm\.|linear_qkv\.layer_norm_)bias"
    ):
        run_ranks(load_with_a_norm_bias, 1, str(checkpoints["old"]))
