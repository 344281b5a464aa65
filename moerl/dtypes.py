"""The one dtype table: the names configs, checkpoints and the wire use, and what ``auto`` means."""

from __future__ import annotations

import torch

# Floating-point dtypes a model is held in, by the name configs and checkpoint metadata write.
MODEL_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What a weight-broadcast bucket may carry (SGLang's names: torch's, without the "torch." prefix).
WIRE_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "float8_e4m3fn")


def resolve(name: str) -> str:
    """``auto`` is bfloat16 where CUDA is available and float32 on the CPU; any other name is itself."""
    if name != "auto":
        return name
    return "bfloat16" if torch.cuda.is_available() else "float32"


def torch_dtype(name: str) -> torch.dtype:
    return MODEL_DTYPES[resolve(name)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
