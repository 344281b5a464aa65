"""The CPU layer for megatron-core: every patch target exists in the pinned megatron-core, the
patches take effect, and a moved target is reported by name instead of half-applying."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from moerl.megatron import cpu_compat


def test_every_patch_target_exists():
    import importlib

    missing = [
        f"{module}.{attr}"
        for module, attr, _ in cpu_compat._patches()
        if not hasattr(importlib.import_module(module), attr)
    ]
    assert missing == []


def test_a_moved_target_raises_compat_error_naming_it(monkeypatch):
    monkeypatch.setattr(
        cpu_compat, "_patches", lambda: [("megatron.core.tensor_parallel.random", "_renamed_in_a_new_release", None)]
    )
    with pytest.raises(
        cpu_compat.CompatError, match=r"megatron\.core\.tensor_parallel\.random\._renamed_in_a_new_release"
    ):
        cpu_compat._patch(*cpu_compat._patches()[0])


@pytest.mark.e2e
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the layer is applied only without CUDA")
def test_apply_makes_cuda_device_arguments_land_on_the_cpu():
    # In a fresh interpreter: the layer installs a process-wide torch function mode.
    code = textwrap.dedent(
        """
        import torch
        from moerl.megatron import cpu_compat
        assert cpu_compat.apply() is True
        assert cpu_compat.apply() is True  # idempotent
        a = torch.empty(3, device=torch.cuda.current_device())
        b = torch.zeros(2).cuda()
        c = torch.ones(2).to("cuda")
        from megatron.core.transformer.utils import get_default_causal_mask
        m = get_default_causal_mask(4)
        print(a.device, b.device, c.device, m.device, m.shape)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["cpu", "cpu", "cpu", "cpu", "torch.Size([4,", "4])"]
