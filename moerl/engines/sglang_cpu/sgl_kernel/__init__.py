"""The two sgl-kernel CPU operators SGLang 0.5.23 imports on a CPU without AMX, in plain torch.

SGLang's CPU engine falls back to torch for norms, MoE and attention there, but imports these two from sgl-kernel's
CPU build, which is not on PyPI (PyPI's sgl-kernel is CUDA-only). moerl puts this package on the SGLang server's
PYTHONPATH when it starts one on the CPU (:mod:`moerl.engines.sglang`); it is never imported by moerl itself. Any other
operator raises when called, so a code path that needs more of sgl-kernel fails naming it instead of running something
else.
"""

from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Request i's token slots ``[start_offset[i], end_offset[i])`` take the next ``end - start`` entries of
    ``out_cache_loc``, which holds the batch's new slots request after request (SGLang's triton kernel of this name)."""
    del pool_len  # the row length, which the triton kernel needs for its pointer arithmetic; the tensor knows it
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start].to(req_to_token.dtype)
        taken += end - start


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In every KV buffer (``data_ptrs[b]``, rows of ``strides[b]`` bytes), row ``tgt_loc[j]`` becomes a copy of row
    ``src_loc[j]``; all rows are read before any is written, as the tiled kernel does."""
    if tgt_loc.numel() == 0:
        return
    rows = int(max(int(tgt_loc.max()), int(src_loc.max()))) + 1
    tgt, src = tgt_loc.long(), src_loc.long()
    for pointer, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(pointer))
        buffer = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        buffer[tgt] = buffer[src]


def __getattr__(name: str):
    """SGLang imports more of sgl-kernel at module level than a CPU server calls (speculative decoding's trees, say):
    any other operator imports, and raises naming itself if it is ever called."""
    if name.startswith("__"):  # what the import system and tools probe for
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: moerl's CPU stand-in for sgl-kernel has only assign_req_to_token_pool_cpu and "
            "copy_all_layer_kv_cache_cpu; this SGLang code path needs the real CPU build of sgl-kernel"
        )

    missing.__name__ = name
    return missing
