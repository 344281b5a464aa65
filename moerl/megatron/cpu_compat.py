"""Run megatron-core on CPU processes (gloo) where no CUDA device exists.

megatron-core 0.16.1 assumes CUDA everywhere: ~200 ``torch.cuda.current_device()`` calls used as a
``device=`` argument, ``device="cuda"`` literals in the pipeline schedules and in
``get_default_causal_mask``, CUDA streams in the alltoall token dispatcher, and a CUDA RNG tracker.
Instead of patching each call site, one ``TorchFunctionMode`` maps every CUDA device argument to the
CPU; the few things a mode cannot see (attribute lookups on ``torch.cuda`` and module-level
functions) are patched by name below.  Each patch names its target; :func:`apply` raises
:class:`CompatError` when a target has moved, so a megatron-core upgrade fails loudly instead of
running with half a compatibility layer.

Applied only when ``torch.cuda.is_available()`` is false: with a GPU nothing here is touched, except
:func:`bind_te_general_gemm`, which repairs megatron-core without Transformer Engine on every device.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_applied = False


class CompatError(RuntimeError):
    """A megatron-core symbol this layer patches is gone: the pinned version changed."""


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal (torch.cuda.current_device() returns one); without CUDA there is
    # no other meaning for it.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of any torch call to the CPU.

    Targets, among others: ``torch.empty(..., device=torch.cuda.current_device())`` in
    ``megatron.core.tensor_parallel`` and ``transformer.moe``, ``device="cuda"`` in
    ``megatron.core.pipeline_parallel.schedules`` / ``p2p_communication`` and
    ``megatron.core.transformer.utils.get_default_causal_mask``, and ``Tensor.cuda()``.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _NoStream:
    """Stand-in for ``torch.cuda.Stream``: CPU work is ordered, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return self

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    def __hash__(self):
        return 0


_THE_STREAM = _NoStream()


def _patch(module_name: str, attr: str, value: Any) -> None:
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise CompatError(
            f"cpu_compat: {module_name}.{attr} no longer exists; the megatron-core version changed "
            f"(moerl pins 0.16.1). Update moerl/megatron/cpu_compat.py."
        )
    setattr(module, attr, value)


def _cpu_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(state)


def _clip_grads_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """megatron's clip_grad_by_total_norm_fp32 minus its assertion that grads are CUDA tensors."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for param in parameters:
            grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
            if grad is not None:
                grad.detach().mul_(coeff)


@functools.lru_cache(maxsize=8)
def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _patches() -> list[tuple[str, str, Any]]:
    return [
        # Used as a device argument ~200 times, also inside autograd backward functions
        # (tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward), where
        # torch function modes are not active: answer with the CPU itself.
        ("torch.cuda", "current_device", lambda: "cpu"),
        # MoEAlltoAllTokenDispatcher creates a D2H side stream and waits on it.
        ("torch.cuda", "Stream", _NoStream),
        ("torch.cuda", "current_stream", lambda *a, **k: _THE_STREAM),
        ("torch.cuda", "stream", lambda *a, **k: contextlib.nullcontext()),
        ("torch.cuda", "synchronize", lambda *a, **k: None),
        # The CUDA RNG tracker (tensor_parallel.random.CudaRNGStatesTracker) forks the device
        # generator around dropout and initialisation; on CPU the device generator is the CPU one.
        ("torch.cuda", "get_rng_state", _cpu_rng_state),
        ("torch.cuda", "manual_seed", torch.manual_seed),
        ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _cpu_rng_state),
        ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _set_cpu_rng_state),
        # The causal mask is built with device="cuda"; under activation recompute that happens inside
        # the backward pass, where torch function modes are not active.
        ("megatron.core.fusions.fused_softmax", "get_default_causal_mask", _causal_mask),
        # Gradient clipping asserts grads are torch.cuda.FloatTensor (optimizer.py imports it by name).
        ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32", _clip_grads_by_total_norm),
    ]


def apply() -> bool:
    """Install the CPU layer once per process if CUDA is absent. Returns True when applied."""
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available():
        return False
    for module_name, attr, value in _patches():
        _patch(module_name, attr, value)
    _patch_alltoall_split_sizes()
    CudaToCpuMode().__enter__()  # stays on the mode stack for the life of the process
    _applied = True
    return True


def bind_te_general_gemm() -> None:
    """``megatron.core.transformer.moe.moe_utils.router_gating_linear`` tests
    ``te_general_gemm is not None``, but without Transformer Engine the import fails and the name
    is never bound (NameError): bind it to None. Needed on a GPU without Transformer Engine as much as on
    the CPU (the router's first forward on an H100 raised it), so applied on every device."""
    import inspect

    import megatron.core.transformer.moe.moe_utils as moe_utils

    if "te_general_gemm is not None" not in inspect.getsource(moe_utils):
        raise CompatError(
            "cpu_compat: megatron.core.transformer.moe.moe_utils no longer tests te_general_gemm; "
            "the megatron-core version changed (moerl pins 0.16.1). Update moerl/megatron/cpu_compat.py."
        )
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_alltoall_split_sizes() -> None:
    """``tensor_parallel.mappings.all_to_all`` passes split sizes that may be tensors; gloo's
    ``all_to_all_single`` wants Python lists."""
    import megatron.core.tensor_parallel.mappings as mappings

    target = "_AllToAll"
    if not hasattr(mappings, target):
        raise CompatError(f"cpu_compat: megatron.core.tensor_parallel.mappings.{target} is gone.")
    original_forward: Callable = mappings._AllToAll.forward

    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        as_list = lambda s: s.tolist() if isinstance(s, torch.Tensor) else s
        return original_forward(ctx, group, input, as_list(output_split_sizes), as_list(input_split_sizes))

    mappings._AllToAll.forward = staticmethod(forward)
