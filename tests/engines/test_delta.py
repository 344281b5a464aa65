"""The delta codec (moerl.engines.delta) and its engine side: SGLang's custom weight loader followed on a hand-made
model whose load_weights is written the way SGLang's are (fused q/k/v, stacked experts, tensor-parallel slices)."""

from __future__ import annotations

import base64
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from moerl.engines.delta import (
    SEP,
    Delta,
    DeltaRefused,
    apply_delta,
    apply_to,
    decode,
    encode,
    inline_payload,
)

DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, as integers (equal bits: equal tensors, NaNs and signed zeros too)."""
    twin = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(twin)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def changed(tensor: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """``tensor`` with about ``fraction`` of its elements given new values."""
    g = torch.Generator().manual_seed(seed)
    which = torch.rand(tensor.shape, generator=g) < fraction
    fresh = (torch.randn(tensor.shape, generator=g) * 3).to(tensor.dtype)
    return torch.where(which, fresh, tensor)


def applied(previous: torch.Tensor, encoding) -> torch.Tensor:
    """What an engine holding ``previous`` holds after receiving ``encoding``."""
    held = previous.clone()
    for name, got in decode(encoding.named):
        if isinstance(got, Delta):
            apply_to(held, got)
        else:
            held = got.clone()
        assert name == "w"
    return held


def kind(encoding) -> str:
    parts = {name.partition(SEP)[2] for name, _ in encoding.named}
    return "nothing" if not parts else "full" if parts == {""} else "indices" if "indices" in parts else "mask"


# ---- the codec -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.3, 0.9])
def test_round_trip(dtype, fraction):
    previous = torch.randn(64, 96).to(dtype)
    current = changed(previous, fraction)
    encoding = encode("w", previous, current)
    assert same_bits(applied(previous, encoding), current)
    differ = int((bits(previous) != bits(current)).sum())
    assert encoding.changed == differ and encoding.numel == current.numel()
    assert encoding.full_bytes == current.numel() * current.element_size()
    assert encoding.sent_bytes == sum(t.numel() * t.element_size() for _, t in encoding.named)
    assert encoding.sent_bytes <= encoding.full_bytes


def test_round_trip_scales():
    """Block scales of an fp8 weight: a small fp32 tensor of one column, a few blocks rescaled."""
    previous = torch.rand(400, 1) + 0.5
    current = previous.clone()
    current[[3, 17]] *= 2
    encoding = encode("w", previous, current)
    assert kind(encoding) == "indices" and encoding.changed == 2
    assert same_bits(applied(previous, encoding), current)


def test_choice_by_size():
    big = torch.randn(100_000)
    one = big.clone()
    one[12345] += 1
    assert kind(encoding := encode("w", big, one)) == "indices"
    assert encoding.sent_bytes == 8 + 4 + 4  # shape, one int32 index, one value
    assert kind(encode("w", big, changed(big, 0.2))) == "mask"
    assert kind(encoding := encode("w", big, changed(big, 0.5), max_fraction=0.5)) == "full"
    assert encoding.named[0][0] == "w" and encoding.sent_bytes == encoding.full_bytes
    # A delta of just under half of the bytes is still sent as one.
    assert kind(encode("w", big, changed(big, 0.2), max_fraction=0.25)) == "mask"
    assert kind(encode("w", big, changed(big, 0.2), max_fraction=0.2)) == "full"


def test_mask_is_packbits():
    previous = torch.randn(1001)  # not a whole number of bytes
    current = changed(previous, 0.3)
    mask = dict(encode("w", previous, current).named)[f"w{SEP}mask"]
    differ = (bits(previous) != bits(current)).numpy()
    assert np.array_equal(mask.numpy(), np.packbits(differ))


def test_no_change_sends_nothing():
    previous = torch.randn(8, 8, dtype=torch.bfloat16)
    encoding = encode("w", previous, previous.clone())
    assert encoding.named == [] and encoding.changed == 0 and encoding.sent_bytes == 0
    assert encoding.full_bytes == 128


def test_whole_when_new_reshaped_or_recast():
    current = torch.randn(4, 6)
    for previous in (None, current.reshape(6, 4), current.double()):
        encoding = encode("w", previous, current)
        ((name, sent),) = encoding.named
        assert name == "w" and same_bits(sent, current) and encoding.changed == encoding.numel == 24


def test_bits_not_values():
    """NaN's payload and the sign of zero are changes; the same NaN is none."""
    nan = torch.tensor([float("nan")])
    other_nan = (bits(nan) + 1).view(torch.float32)
    assert torch.isnan(other_nan).all()
    previous = torch.cat([nan, torch.tensor([0.0, 1.0, 2.0])])
    current = torch.cat([other_nan, torch.tensor([-0.0, 1.0, 2.0])])
    encoding = encode("w", previous, current, max_fraction=1.0)
    assert encoding.changed == 2
    assert same_bits(applied(previous, encoding), current)
    assert encode("w", previous, previous.clone()).named == []


def malformed() -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Payloads decode refuses, by what is wrong with them: a delta of elements 2 and 7 of 100, broken."""
    previous = torch.randn(100)
    current = previous.clone()
    current[[2, 7]] += 1
    parts = dict(encode("w", previous, current).named)
    shape, indices, values = parts[f"w{SEP}shape"], parts[f"w{SEP}indices"], parts[f"w{SEP}values"]
    mask = torch.zeros(13, dtype=torch.uint8)
    mask[0] = 0b00100001  # elements 2 and 7
    ((_, delta),) = decode([(f"w{SEP}shape", shape), (f"w{SEP}mask", mask), (f"w{SEP}values", values)])
    assert delta.indices.tolist() == [2, 7]
    past, more = mask.clone(), mask.clone()
    past[12] = 0b00001000  # element 100
    more[0] = 0b00100011  # and element 6
    return {
        "indices alone": [(f"w{SEP}shape", shape), (f"w{SEP}indices", indices)],
        "values alone": [(f"w{SEP}shape", shape), (f"w{SEP}values", values)],
        "no shape": [(f"w{SEP}indices", indices), (f"w{SEP}values", values)],
        "indices and mask": [
            (f"w{SEP}shape", shape),
            (f"w{SEP}indices", indices),
            (f"w{SEP}mask", mask),
            (f"w{SEP}values", values),
        ],
        "a value short": [(f"w{SEP}shape", shape), (f"w{SEP}indices", indices), (f"w{SEP}values", values[:1])],
        "an index past the end": [
            (f"w{SEP}shape", shape),
            (f"w{SEP}indices", torch.tensor([2, 100], dtype=torch.int32)),
            (f"w{SEP}values", values),
        ],
        "indices not ascending": [
            (f"w{SEP}shape", shape),
            (f"w{SEP}indices", torch.tensor([7, 2], dtype=torch.int32)),
            (f"w{SEP}values", values),
        ],
        "float indices": [(f"w{SEP}shape", shape), (f"w{SEP}indices", indices.float()), (f"w{SEP}values", values)],
        "mask bits past the end": [
            (f"w{SEP}shape", shape),
            (f"w{SEP}mask", past),
            (f"w{SEP}values", torch.cat([values, values[:1]])),
        ],
        "mask too short": [(f"w{SEP}shape", shape), (f"w{SEP}mask", mask[:1]), (f"w{SEP}values", values)],
        "mask of another count": [
            (f"w{SEP}shape", shape),
            (f"w{SEP}mask", more),
            (f"w{SEP}values", values),
        ],
        "unknown part": [(f"w{SEP}shape", shape), (f"w{SEP}index", indices), (f"w{SEP}values", values)],
        "a part twice": [
            (f"w{SEP}shape", shape),
            (f"w{SEP}indices", indices),
            (f"w{SEP}values", values),
            (f"w{SEP}values", values),
        ],
        "whole and delta": [("w", current), (f"w{SEP}shape", shape), (f"w{SEP}indices", indices)],
        "whole twice": [("w", current), ("w", current)],
    }


@pytest.mark.parametrize("case", list(malformed()))
def test_decode_refuses_malformed(case):
    with pytest.raises(ValueError, match="^w: "):
        decode(malformed()[case])


def test_apply_to_strided_views():
    """A delta written into the tensor as an engine holds it: transposed, a slice, another dtype, a scalar."""
    previous = torch.randn(6, 5, dtype=torch.bfloat16)
    current = changed(previous, 0.2)
    (delta,) = (got for _, got in decode(encode("w", previous, current, max_fraction=1.0).named))
    held = torch.randn(5, 9)
    held[:, 2:8].t().copy_(previous)
    view = held[:, 2:8].t()  # fp32, non-contiguous, offset
    apply_to(view, delta)
    expected = torch.randn(5, 9)
    expected.copy_(held)
    expected[:, 2:8].t().copy_(current)
    assert same_bits(held, expected)
    scalar = torch.tensor(1.5)
    # a scalar's delta outweighs it (an index and a value): sent as one only when told to
    (delta,) = (got for _, got in decode(encode("w", scalar, torch.tensor(2.5), max_fraction=3).named))
    assert isinstance(delta, Delta)
    apply_to(scalar, delta)
    assert scalar.item() == 2.5
    with pytest.raises(ValueError, match="a delta of a"):
        apply_to(torch.zeros(5, 6), delta)


def test_inline_payload():
    """Bytes in the payload itself, each dtype kept (SGLang's restricted unpickler: tests/sglang/test_delta_loader)."""
    big = torch.randn(1000, 4)
    assert len(base64.b64decode(inline_payload([("a", big[2:4])]))) < 1000  # a view's storage is not sent whole
    named = [("a", big[2:4]), ("b", torch.randn(5).to(torch.float8_e4m3fn)), ("c", big.t()), ("d", torch.tensor(3))]
    back = pickle.loads(base64.b64decode(inline_payload(named)))
    assert [name for name, _ in back] == ["a", "b", "c", "d"]
    for (_, sent), (_, got) in zip(named, back, strict=True):
        assert same_bits(sent, got)


# ---- SGLang's loader, followed -------------------------------------------------------------------------------------

H, D, HQ, HKV, E, FF, V = 8, 2, 4, 2, 3, 6, 10  # hidden, head dim, q and kv heads, experts, expert width, vocabulary
TP_RANK, TP = 1, 2  # the engine is tensor-parallel rank 1 of 2


def hub(seed: int) -> dict[str, torch.Tensor]:
    """The Hub tensors of the hand-made model (bf16, as a trainer pushes them)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proj.weight": (HQ * D, H),
        "k_proj.weight": (HKV * D, H),
        "v_proj.weight": (HKV * D, H),
        "o_proj.weight": (H, HQ * D),
        "dense.weight": (H, H),
        "lm_head.weight": (V, H),
        "embed.weight": (V, H),
        "norm.weight": (H,),
        "bias.weight": (H,),
        **{f"experts.{e}.{p}.weight": (FF, H) for e in range(E) for p in ("gate_proj", "up_proj")},
        **{f"experts.{e}.down_proj.weight": (H, FF) for e in range(E)},
    }
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in shapes.items()}


class SGLangLike(nn.Module):
    """Parameters fused, stacked and sharded as SGLang holds them (garbage until loaded), filled by a ``load_weights``
    written the way SGLang's are: views of the loaded tensor copied into views of the parameters, the vocabulary's
    padding zeroed."""

    def __init__(self):
        super().__init__()
        rows = (HQ + 2 * HKV) * D // TP
        self.qkv_proj = nn.Parameter(torch.randn(rows, H, dtype=torch.bfloat16), requires_grad=False)
        self.o_proj = nn.Parameter(torch.randn(H, HQ * D // TP), requires_grad=False)  # row-parallel
        self.w13 = nn.Parameter(torch.randn(E, 2 * FF, H), requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(E, H, FF), requires_grad=False)
        self.dense = nn.Parameter(torch.randn(H, H), requires_grad=False)  # held transposed
        self.lm_head_t = nn.Parameter(torch.randn(H, V), requires_grad=False)  # loaded transposed
        self.embed = nn.Parameter(torch.randn(V + 2, H), requires_grad=False)  # vocabulary padded
        self.norm = nn.Parameter(torch.randn(H), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(2, H), requires_grad=False)  # one tensor broadcast to two rows

    def load_qkv(self, loaded: torch.Tensor, shard: str) -> None:
        sizes = {"q": HQ * D // TP, "k": HKV * D // TP, "v": HKV * D // TP}
        offset = {"q": 0, "k": sizes["q"], "v": sizes["q"] + sizes["k"]}[shard]
        dst = self.qkv_proj.data.narrow(0, offset, sizes[shard])
        dst.copy_(loaded.narrow(0, TP_RANK * sizes[shard], sizes[shard]))

    def load_weights(self, weights) -> None:
        for name, loaded in weights:
            if name in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
                self.load_qkv(loaded, name[0])
            elif name == "o_proj.weight":
                width = HQ * D // TP
                self.o_proj.data.copy_(loaded.narrow(1, TP_RANK * width, width))
            elif name.startswith("experts."):
                _, e, proj, _ = name.split(".")
                if proj == "down_proj":
                    self.w2.data.select(0, int(e)).copy_(loaded)
                else:
                    half = 0 if proj == "gate_proj" else 1
                    self.w13.data.select(0, int(e)).narrow(0, half * FF, FF).copy_(loaded)
            elif name == "dense.weight":
                self.dense.data.t().copy_(loaded)
            elif name == "lm_head.weight":
                self.lm_head_t.data.copy_(loaded.t())
            elif name == "embed.weight":
                self.embed.data[: loaded.shape[0]].copy_(loaded)
                self.embed.data[loaded.shape[0] :].fill_(0)
            elif name == "norm.weight":
                self.norm.data.copy_(loaded)
            elif name == "bias.weight":
                self.bias.data.copy_(loaded)


def loaded(weights: dict[str, torch.Tensor]) -> SGLangLike:
    model = SGLangLike()
    model.load_weights(list(weights.items()))
    return model


def assert_same_params(model: nn.Module, reference: nn.Module) -> None:
    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert same_bits(param.data, theirs[name].data), name


def wire(previous: dict[str, torch.Tensor], current: dict[str, torch.Tensor], max_fraction: float = 0.5) -> list:
    return [pair for name in current for pair in encode(name, previous.get(name), current[name], max_fraction).named]


def test_apply_delta_equals_a_full_push():
    a = hub(0)
    b = {name: changed(t, [0.01, 0.15][i % 2], seed=i) for i, (name, t) in enumerate(a.items())}
    b["norm.weight"] = torch.randn(H).to(torch.bfloat16)  # every element: sent whole
    b["experts.1.up_proj.weight"] = a["experts.1.up_proj.weight"].clone()  # unchanged: not sent
    sent = wire(a, b)
    kinds = {name.partition(SEP)[2] for name, _ in sent}
    assert {"", "indices", "mask"} <= kinds
    model = loaded(a)
    apply_delta(model, sent)
    assert_same_params(model, loaded(b))
    # Back again, through the copies recorded the first time.
    apply_delta(model, wire(b, a, max_fraction=1.0))
    assert_same_params(model, loaded(a))


def test_apply_delta_follows_a_replaced_storage():
    a, b = hub(0), hub(1)
    model = loaded(a)
    apply_delta(model, wire(a, a | {"dense.weight": b["dense.weight"]}, max_fraction=1.0))
    model.dense.data = model.dense.data.clone()  # as a post-load step may swap a weight's storage
    apply_delta(model, wire(a | {"dense.weight": b["dense.weight"]}, a, max_fraction=1.0))
    assert_same_params(model, loaded(a))


class Loader(nn.Module):
    """One parameter filled by ``load``."""

    def __init__(self, load):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 6), requires_grad=False)
        self.load = load
        self.kept: list[torch.Tensor] = []

    def load_weights(self, weights) -> None:
        for _, tensor in weights:
            self.load(self, tensor)


@pytest.mark.parametrize(
    "load, why",
    [
        (lambda m, t: m.weight.data.copy_(t.float()), "aten._to_copy"),
        (lambda m, t: m.weight.data.copy_(t.t().contiguous().t()), "aten.clone"),
        (lambda m, t: m.weight.data.copy_(torch.cat([t[:2], t[2:]])), "aten.cat"),
        (lambda m, t: m.weight.data.fill_(t.sum().item()), "aten.sum"),
        (lambda m, t: m.kept.append(t), "keeps the tensor"),
        (lambda m, t: torch.zeros(4, 6).copy_(t), "not a parameter or buffer"),
    ],
    ids=["cast", "contiguous", "cat", "item", "kept", "elsewhere"],
)
def test_apply_delta_refuses(load, why):
    previous = torch.randn(4, 6, dtype=torch.bfloat16)
    current = previous.clone()
    current[1, 2] = 7
    model = Loader(load)
    before = model.weight.data.clone()
    with pytest.raises(DeltaRefused, match="^w: .*set sync.delta=false") as e:
        apply_delta(model, encode("w", previous, current).named)
    assert why in str(e.value)
    assert same_bits(model.weight.data, before)  # nothing written
