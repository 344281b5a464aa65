"""Three diversions SGLang 0.5.23 needs to serve on a machine without a GPU, applied in each of its processes.

moerl puts this directory on the SGLang server's PYTHONPATH when it starts one on the CPU
(:func:`moerl.engines.sglang.cpu_server_env`); Python imports this module at start-up in the server and in the
scheduler processes it spawns. Nothing in site-packages is edited. Each diversion is applied right after the module it
changes is imported, and only when ``SGLANG_USE_CPU_ENGINE=1``:

- ``sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS`` has no ``cpu`` entry, and its default pins the host
  buffer with ``cudaHostRegister``; ``--enable-return-routed-experts`` allocates its routing buffer through it. On the
  CPU the buffer is a plain tensor.
- ``torch.get_device_module()`` without an argument answers ``torch.cuda`` on a CUDA build of torch even with no GPU,
  and SGLang's release of memory occupation calls ``.synchronize()`` on it. With no device named, it answers
  ``torch.cpu``.
- Qwen2-MoE's gated shared expert (``sglang.srt.models.qwen2_moe.fused_gate_sigmoid_mul_add``) is a triton kernel,
  which has no CPU driver: on the CPU it is the same sum in plain torch, in fp32 as the kernel computes it.

A ``sitecustomize`` that this one shadows (later on ``sys.path``) still runs, after these are installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path


def _alloc_on_cpu(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    import torch

    return torch.empty(dims, dtype=dtype, device=device)


def _divert_host_alloc(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_on_cpu


def _gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states) -> None:
    import torch

    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float()).unsqueeze(-1)
    final_hidden_states.copy_(final_hidden_states.float() + gate * shared_output.float())


def _divert_shared_expert_gate(module) -> None:
    module.fused_gate_sigmoid_mul_add = _gate_sigmoid_mul_add


def _divert_device_module(torch) -> None:
    named = torch.get_device_module

    def get_device_module(device=None):
        return torch.cpu if device is None else named(device)

    torch.get_device_module = get_device_module


DIVERSIONS: dict[str, Callable] = {
    "sglang.srt.mem_cache.pool_host.common": _divert_host_alloc,
    "sglang.srt.models.qwen2_moe": _divert_shared_expert_gate,
    "torch": _divert_device_module,
}


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the modules of :data:`DIVERSIONS` with the other finders, and applies each one's diversion once it has
    run."""

    def __init__(self) -> None:
        self.loaders: dict[str, importlib.abc.Loader] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in DIVERSIONS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                self.loaders[fullname] = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        return self.loaders[spec.name].create_module(spec)

    def exec_module(self, module) -> None:
        self.loaders[module.__name__].exec_module(module)
        DIVERSIONS[module.__name__](module)


def _run_shadowed_sitecustomize() -> None:
    here = Path(__file__).resolve().parent
    rest = [p for p in sys.path if p and Path(p).resolve() != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _AfterImport())
_run_shadowed_sitecustomize()
