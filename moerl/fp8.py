"""Block-wise FP8 (e4m3) weights and per-token-group FP8 activations, as SGLang 0.5.23 serves a checkpoint whose
``quantization_config`` is :data:`QUANTIZATION_CONFIG` (DeepSeek-V3's format): each 128 x 128 block of a linear weight
is ``q = clamp(w / s)`` in float8_e4m3fn with ``s = max(|block|, 1e-10) / 448`` kept as ``<name>_scale_inv`` (fp32,
ceil(N/128) x ceil(K/128)), and each 128 channels of each token's input are quantized the same way on the fly.

The trainer quantizes every weight it pushes (:func:`quantize_named`), so the engines hold exactly what it computed and
never quantize again: SGLang's own online ``--quantization fp8`` is per-channel, and swaps in parameters a later push
cannot load. The embedded engine emulates the same arithmetic on the CPU (:mod:`moerl.engines.embedded.fp8`).

Which tensors are FP8 is SGLang's choice for Qwen2/3-MoE: the linear projections inside the decoder layers (attention,
experts, the shared expert); embeddings, lm_head, norms, biases, the router gate and Qwen2-MoE's shared-expert gate stay
in the model dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

import torch

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_SUFFIX = "_scale_inv"
# The quantization_config of an FP8 checkpoint moerl writes (and of the engines that serve it).
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [BLOCK, BLOCK],
}
QUANTIZATIONS = ("none", "fp8")
_QUANTIZED = re.compile(r"model\.layers\.\d+\..*_proj\.weight")


def is_quantized(hub_name: str) -> bool:
    """Whether the engines hold the Hub tensor ``hub_name`` in FP8 (a decoder layer's linear projection)."""
    return _QUANTIZED.fullmatch(hub_name) is not None


def scale_name(hub_name: str) -> str:
    return hub_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    rows, cols = shape
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``x`` (N x K) zero-padded to whole blocks, as (N/128, 128, K/128, 128); and N, K."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x, (0, -cols % BLOCK, 0, -rows % BLOCK))
    return padded.unflatten(1, (-1, BLOCK)).unflatten(0, (-1, BLOCK)), rows, cols


def _fp8_max(like: torch.Tensor) -> torch.Tensor:
    """448 as a tensor: CUDA divides by a Python number as a multiplication by its inverse, which rounds otherwise
    than the CPU's division, so a scale computed at engine start (CPU) and at a push (the trainer's GPU) would differ
    in its last bit."""
    return torch.tensor(FP8_MAX, dtype=torch.float32, device=like.device)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` of a 2-D weight: float8_e4m3fn of its shape, and fp32 per 128 x 128 block. Computed in fp32,
    so the same weight gives the same bytes on any device."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantization takes a 2-D weight, not shape {tuple(weight.shape)}")
    blocks, rows, cols = _blocks(weight.detach().float())
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10) / _fp8_max(blocks)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight an FP8 engine computes with: ``q * scale_inv`` blockwise, in ``dtype``."""
    rows, cols = q.shape
    full = scale_inv.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return (q.float() * full).to(dtype)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an FP8 engine's GEMM sees it: each token's channels in groups of 128, each group scaled by its own
    absmax / 448 into float8_e4m3fn and back (SGLang's per_token_group_quant_fp8, dequantized)."""
    cols = x.shape[-1]
    groups = torch.nn.functional.pad(x.float(), (0, -cols % BLOCK)).unflatten(-1, (-1, BLOCK))
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10) / _fp8_max(groups)
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.float() * scale).flatten(-2)[..., :cols].to(x.dtype)


def quantize_named(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Hub tensors as an FP8 engine loads them: each quantized one as its FP8 weight then its scales, the rest as
    they are."""
    for name, tensor in named:
        if is_quantized(name):
            q, scale = quantize(tensor)
            yield name, q
            yield scale_name(name), scale
        else:
            yield name, tensor


def hub_bytes(shapes: dict[str, tuple[int, ...]], itemsize: int) -> int:
    """Bytes of a model's Hub tensors ``shapes`` served in FP8: one byte per quantized element plus its fp32 scales,
    ``itemsize`` per element of the rest."""
    total = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        total += numel + 4 * math.prod(scale_shape(shape)) if is_quantized(name) else numel * itemsize
    return total


def check_shards(shapes: dict[str, tuple[int, ...]], tp_size: int) -> str | None:
    """Why an FP8 engine of tensor-parallel size ``tp_size`` cannot hold these Hub tensors (None: it can). SGLang
    requires each rank's share of a block-quantized weight to be whole blocks: a column-parallel weight's rows, a
    row-parallel weight's columns."""
    if tp_size == 1:
        return None
    for name, shape in shapes.items():
        if not is_quantized(name):
            continue
        row_parallel = name.endswith(("o_proj.weight", "down_proj.weight"))
        dim = shape[1] if row_parallel else shape[0]
        if dim % tp_size or (dim // tp_size) % BLOCK:
            return (
                f"{name} {tuple(shape)}: its {'columns' if row_parallel else 'rows'} ({dim}) split over "
                f"{tp_size} tensor-parallel ranks are not whole {BLOCK}-wide FP8 blocks"
            )
    return None
