"""Megatron checkpoints in megatron-core ``dist_checkpointing`` format (torch_dist backend).

The format is reshardable: a checkpoint written at one TP/EP/PP layout loads at any other. moerl
always uses per-layer keys (``non_homogeneous_layers``), which dense-interleaved models need anyway
and which let the converter write one layer at a time. A checkpoint directory also keeps the HF
config and tokenizer files under ``hf/`` so it converts back and can be served.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values, merge
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.models.gpt import GPTModel

from moerl.checkpoint.hf import CheckpointError, read_config
from moerl.env import die_with_parent, exit_with_importing
from moerl.layout import Layout
from moerl.megatron.model import build_model
from moerl.megatron.parallel import init_distributed
from moerl.models import family_for

SHARDED_METADATA = {"non_homogeneous_layers": True}
# 2: a MoE layer's pre-MLP norm is stored as "pre_mlp_layernorm.weight", as Transformer Engine's spec stores
#    it (1 stored it as "mlp.linear_fc1.layer_norm_weight", which a TE model does not load).
# 3: every norm stores an (empty) "_extra_state", as Transformer Engine's norm does (2 stored none, which a TE model
# asks for).
FORMAT_VERSION = 3
HF_SUBDIR = "hf"
MOERL_META = "moerl.json"
TRAINER_STATE = "trainer.json"  # a trainer checkpoint's version, schedule and config (incl. LoRA), by Trainer.save


def read_moerl_meta(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / MOERL_META
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir}: no {MOERL_META}; not a moerl Megatron checkpoint (convert one with tools/convert_ckpt.py "
            "hf-to-mcore)"
        )
    return json.loads(path.read_text())


def hf_config_of(ckpt_dir: str | Path) -> dict:
    return read_config(Path(ckpt_dir) / HF_SUBDIR)


def load_sharded(sharded: dict, ckpt_dir: str | Path) -> dict:
    """``dist_checkpointing.load`` of a moerl checkpoint of any format version, into a model of either spec.

    A module's extra state the checkpoint does not hold (format 2 and older wrote none for the norms, a model built
    with Transformer Engine none for a norm it fuses into a linear layer) keeps its value: it comes back as the module
    holds it, so loading it into the module, strictly, leaves the module as it was. Any other key the checkpoint lacks
    fails."""
    if read_moerl_meta(ckpt_dir).get("format_version", 1) < 2:

        def legacy(item):
            if hasattr(item, "key") and ".pre_mlp_layernorm." in item.key:  # only MoE layers still have one
                item.key = item.key.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")
            return item

        dict_list_map_inplace(legacy, sharded)
    held = {item.key for item in load_sharded_metadata(str(ckpt_dir)).values()}

    def absent_extra_state(item) -> bool:
        return isinstance(item, ShardedObject) and item.key.endswith("_extra_state") and item.key not in held

    absent, sharded = extract_matching_values(sharded, absent_extra_state)
    state = dist_checkpointing.load(sharded, str(ckpt_dir))
    dict_list_map_inplace(lambda item: item.data, absent)
    return merge(state, absent)


_saving = False  # while save_sharded runs: what this process forks then is one of megatron-core's checkpoint writers


def _writer_dies_with_saver() -> None:
    if _saving:
        die_with_parent()


os.register_at_fork(after_in_child=_writer_dies_with_saver)


def start_results_queue() -> None:
    """The server of the queue megatron-core's checkpoint writers report through (``filesystem_async._results_queue``,
    a multiprocessing Manager's, kept for the process's life), unless started already. Started by megatron-core at the
    first save, it outlives a SIGKILLed trainer rank (found: one left behind per killed rank, 270 MB each); started
    here, it watches this process and ends with it. It imports torch's checkpoint types, which the writers' results
    unpickle into, as soon as it starts, not at the first save (seconds that every rank's first save waited): a job
    starts it once its trainer is built, and that import runs while the engines start."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        import multiprocessing
        from multiprocessing.managers import SyncManager

        manager = SyncManager(
            ctx=multiprocessing.get_context("spawn")
        )  # spawn, as megatron-core's: this process runs threads
        manager.start(initializer=exit_with_importing, initargs=(os.getpid(), ("torch.distributed.checkpoint",)))
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps its manager


def save_sharded(sharded: dict, ckpt_dir: str | Path, **options) -> None:
    """``dist_checkpointing.save``, its helper processes tied to this one: the results queue's server
    (:func:`start_results_queue`), and the writer processes each save forks: killed mid-save, a rank would leave them
    blocked on a pipe nobody reads."""
    global _saving

    start_results_queue()
    _saving = True
    try:
        dist_checkpointing.save(sharded, str(ckpt_dir), **options)
    finally:
        _saving = False


def write_moerl_meta(ckpt_dir: str | Path, architecture: str, dtype: str, hf_source: str | None) -> None:
    """``hf_source``: the base model that adapters trained from this checkpoint apply to (their PEFT config names
    it); None where the checkpoint it was trained from predates the key."""
    meta = {"format_version": FORMAT_VERSION, "architecture": architecture, "dtype": dtype, "hf_source": hf_source}
    (Path(ckpt_dir) / MOERL_META).write_text(json.dumps(meta, indent=2) + "\n")


def load_model_weights(model: GPTModel, ckpt_dir: str | Path) -> None:
    """Load this rank's shards of a moerl Megatron checkpoint into ``model`` (any layout)."""
    state = load_sharded(model.sharded_state_dict(metadata=SHARDED_METADATA), ckpt_dir)
    model.load_state_dict(state, strict=True)


def load_megatron_model(
    ckpt_dir,
    layout: Layout,
    dtype: torch.dtype = torch.float32,
    transformer_engine: bool | None = None,
    **config_overrides,
):
    """Initialise parallel state for ``layout`` and load a moerl Megatron checkpoint into this rank's model.

    Returns ``(hf_config, model)``.
    """
    init_distributed(layout)
    raw = hf_config_of(ckpt_dir)
    cfg = family_for(raw).normalize(raw)
    model = build_model(cfg, layout, dtype, transformer_engine, **config_overrides)
    load_model_weights(model, ckpt_dir)
    return cfg, model


def merge_layer_checkpoints(root: Path, layer_dirs: list[Path]) -> None:
    """Join checkpoints that each hold a disjoint set of keys into one checkpoint at ``root``.

    The converter saves one ``dist_checkpointing`` checkpoint per weight layer (so memory holds one layer);
    torch DCP reads everything through the root ``.metadata``, whose storage entries name the file
    that holds each chunk, so merging is moving the data files and uniting the metadata.
    """
    merged = None
    for k, layer_dir in enumerate(layer_dirs):
        with open(layer_dir / ".metadata", "rb") as f:
            meta = pickle.load(f)
        renamed = {}
        for data_file in layer_dir.glob("*.distcp"):
            target = f"__layer{k}{data_file.name}"
            shutil.move(str(data_file), root / target)
            renamed[data_file.name] = target
        for info in meta.storage_data.values():
            info.relative_path = renamed[info.relative_path]
        if merged is None:
            merged = meta
            for name in ("metadata.json", "common.pt"):
                shutil.move(str(layer_dir / name), root / name)
        else:
            for key, tensor_meta in meta.state_dict_metadata.items():
                if key in merged.state_dict_metadata:
                    merged.state_dict_metadata[key].chunks.extend(tensor_meta.chunks)
                else:
                    merged.state_dict_metadata[key] = tensor_meta
            merged.storage_data.update(meta.storage_data)
        shutil.rmtree(layer_dir)
    if merged is None:
        raise CheckpointError(f"{root}: no layer checkpoints to merge")
    merged.all_local_plans = None
    with open(root / ".metadata", "wb") as f:
        pickle.dump(merged, f)
        f.flush()
        os.fsync(f.fileno())
