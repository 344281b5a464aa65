"""Weight export for engine sync: at any layout, the stream is the HF checkpoint, bitwise."""

from __future__ import annotations

import pytest
import torch

from moerl.checkpoint.hf import HFReader
from moerl.megatron.launch import run_ranks
from moerl.megatron.parallel import Layout
from tests.conftest import ARCHS
from tests.workers import export_hf


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("world, layout", [(2, Layout(tp=2)), (2, Layout(ep=2)), (2, Layout(pp=2))], ids=["TP2", "EP2", "PP2"])
def test_export_streams_the_hf_checkpoint_bitwise(tiny_ckpts, arch, world, layout):
    hf_dir, mcore_dir = tiny_ckpts[arch]
    reader = HFReader(hf_dir)
    streams = run_ranks(export_hf, world, str(mcore_dir), layout)
    for stream in streams:  # every rank sees the same stream
        names = [name for name, _ in stream]
        assert sorted(names) == sorted(reader.names()) and len(set(names)) == len(names)
        for name, tensor in stream:
            assert torch.equal(tensor, reader.get(name)), name
