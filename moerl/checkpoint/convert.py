"""Exact, streaming conversion between Hugging Face checkpoints and moerl Megatron checkpoints.

The Megatron model is built on the meta device (no memory); one weight layer at a time (the embedding,
norm and output layer, then each decoder layer) is materialised from the HF tensors, saved as a
``dist_checkpointing`` checkpoint of its own, and dropped. Peak memory is about one layer plus what safetensors
maps, so a 30B MoE converts on a 24 GiB machine. Output is written to a temporary sibling directory
and renamed into place only when complete: a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from tqdm import tqdm

from moerl.checkpoint.hf import CheckpointError, HFReader, HFWriter, check_hf_tensors, copy_carried_files, read_config
from moerl.checkpoint.mcore import (
    HF_SUBDIR,
    SHARDED_METADATA,
    TRAINER_STATE,
    hf_config_of,
    load_sharded,
    merge_layer_checkpoints,
    read_moerl_meta,
    save_sharded,
    start_results_queue,
    write_moerl_meta,
)
from moerl.checkpoint.peft import (
    AdapterFiles,
    check_adapter,
    export_adapter,
    merge_into,
    peft_would_drop,
    write_adapter_files,
)
from moerl.dtypes import MODEL_DTYPES, dtype_name
from moerl.files import staged_dir
from moerl.layout import Layout
from moerl.megatron.lora import add_lora
from moerl.megatron.lora_config import LoRAConfig, is_lora_param
from moerl.megatron.model import build_model
from moerl.megatron.parallel import ensure_single_process_env, init_distributed
from moerl.models import ModelFamily, family_for
from moerl.models.family import in_layer


def _staging_dir(out: Path):
    if out.exists():
        raise CheckpointError(f"output directory {out} already exists; choose a new path or remove it")
    return staged_dir(out)


def _meta_model(cfg: dict, dtype: torch.dtype, lora: LoRAConfig | None = None):
    ensure_single_process_env()
    init_distributed(Layout())
    with torch.device("meta"):
        model = build_model(cfg, Layout(), dtype, transformer_engine=None if lora is None else False)
        if lora is not None:
            add_lora(model, lora)
        return model


def checkpoint_lora(mcore_dir: str | Path) -> LoRAConfig | None:
    """The LoRA configuration a trainer checkpoint was trained with (None: full weights)."""
    state = Path(mcore_dir) / TRAINER_STATE
    saved = json.loads(state.read_text()).get("lora") if state.is_file() else None
    return LoRAConfig(**saved) if saved else None


def _set_param(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Swap a parameter for one on another device (meta <-> CPU); ``.data =`` cannot cross devices."""
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[param_name] = torch.nn.Parameter(tensor, requires_grad=False)


def _on_the_cpu(convert):
    """Conversion never needs a GPU, and megatron-core on a CUDA host would place the meta model's layers on
    GPU 0 (``use_cpu_initialization`` is off there) and ``.cuda()`` them: where CUDA is visible, the
    conversion runs in a fresh process that sees none, on the CPU path (one layer plus one shard in memory)."""

    @functools.wraps(convert)
    def on_the_cpu(*args, **kwargs):
        if torch.cuda.is_available():
            from moerl.megatron.launch import run_ranks

            return run_ranks(_call, 1, convert.__name__, args, kwargs, use_cuda=False)[0]
        return convert(*args, **kwargs)

    return on_the_cpu


def _call(name: str, args: tuple, kwargs: dict):
    return globals()[name].__wrapped__(*args, **kwargs)


@_on_the_cpu
def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Convert a HF directory (Hub names, per-expert tensors) to a moerl Megatron checkpoint."""
    hf_dir, out = Path(hf_dir), Path(out_dir)
    raw = read_config(hf_dir)
    family = family_for(raw)
    cfg = family.normalize(raw)
    family.check(cfg)
    reader = HFReader(hf_dir)
    dtype = check_hf_tensors(reader, family, cfg)
    start_results_queue()  # for the saves below: its imports run while the model is built
    with _staging_dir(out) as staging:
        model = _meta_model(cfg, dtype)
        params = dict(model.named_parameters())
        layer_dirs = []
        for k, (prefix, rules) in enumerate(
            tqdm(family.weight_layers(cfg), desc="hf-to-mcore", unit="layer", disable=not progress)
        ):
            for rule in rules:
                tensor = family.to_mcore(rule, [reader.get(n) for n in rule.hf], cfg).to(dtype)
                _set_param(model, rule.mcore, tensor)
            sharded = model.sharded_state_dict(metadata=SHARDED_METADATA)
            layer_dir = staging / f"layer{k}"
            layer_dir.mkdir()
            save_sharded(
                {n: t for n, t in sharded.items() if in_layer(n, prefix)}, layer_dir, validate_access_integrity=False
            )
            layer_dirs.append(layer_dir)
            for rule in rules:
                _set_param(model, rule.mcore, torch.empty_like(params[rule.mcore], device="meta"))
        merge_layer_checkpoints(staging, layer_dirs)
        (staging / HF_SUBDIR).mkdir()
        copy_carried_files(hf_dir, staging / HF_SUBDIR)
        write_moerl_meta(staging, family.architecture, dtype_name(dtype), str(hf_dir.resolve()))
    return out


def _read_checkpoint(mcore_dir: Path) -> tuple[dict, ModelFamily, dict, LoRAConfig | None]:
    """A moerl checkpoint's (metadata, model family, normalised HF config, LoRA config or None)."""
    meta = read_moerl_meta(mcore_dir)
    raw = hf_config_of(mcore_dir)
    family = family_for(raw)
    return meta, family, family.normalize(raw), checkpoint_lora(mcore_dir)


def _adapter_files(mcore_dir: Path, fmt: str, base_model: str | None) -> tuple[AdapterFiles, ModelFamily]:
    """The adapters of a LoRA-trained checkpoint as the files of ``fmt`` (read without the base weights), and its
    family."""
    meta, family, cfg, lora_cfg = _read_checkpoint(mcore_dir)
    if lora_cfg is None:
        raise CheckpointError(
            f"{mcore_dir} holds no LoRA adapters (no lora section in its {TRAINER_STATE}); convert it without "
            "--adapter-only"
        )
    base_model = base_model or meta.get("hf_source")
    if not base_model:
        raise CheckpointError(
            f"{mcore_dir} does not record the HF model it was converted from: pass --base-model "
            "(a directory or Hub id) so the adapter's config names the model it applies to"
        )
    model = _meta_model(cfg, MODEL_DTYPES[meta["dtype"]], lora_cfg)
    params = dict(model.named_parameters())
    adapters = [n for n in params if is_lora_param(n)]
    for name in adapters:
        _set_param(model, name, torch.empty_like(params[name], device="cpu"))
    sharded = model.sharded_state_dict(metadata=SHARDED_METADATA)
    state = load_sharded({n: t for n, t in sharded.items() if is_lora_param(n)}, mcore_dir)
    return export_adapter(family, cfg, {n: state[n] for n in adapters}, lora_cfg, fmt, base_model), family


@_on_the_cpu
def export_adapter_dir(
    mcore_dir: str | Path, out_dir: str | Path, fmt: str, base_model: str | None = None
) -> tuple[Path, list[str]]:
    """A LoRA-trained checkpoint's adapters as an adapter directory of format ``fmt`` (``peft``: what PEFT over
    transformers loads; ``sglang``: what SGLang and ``moerl serve`` load), read back and checked before it
    appears. Returns it and the modules PEFT would drop from it (``sglang`` format with dense or shared MLPs)."""
    mcore_dir, out = Path(mcore_dir), Path(out_dir)
    files, family = _adapter_files(mcore_dir, fmt, base_model)
    with _staging_dir(out) as staging:
        write_adapter_files(staging, files)
        problems = check_adapter(staging, files)
        if problems:
            raise CheckpointError(f"the adapter written to {out} does not read back as written: " + "; ".join(problems))
    return out, peft_would_drop(files, family.model_type) if fmt == "sglang" else []


@_on_the_cpu
def check_adapter_dir(
    mcore_dir: str | Path, adapter_dir: str | Path, fmt: str, base_model: str | None = None
) -> list[str]:
    """Where an adapter directory differs from what the checkpoint's adapters export to in ``fmt`` (with the same
    ``base_model`` as at export)."""
    return check_adapter(adapter_dir, _adapter_files(Path(mcore_dir), fmt, base_model)[0])


@_on_the_cpu
def mcore_to_hf(
    mcore_dir: str | Path,
    out_dir: str | Path,
    progress: bool = True,
    max_shard_bytes: int = 2 * 1024**3,
    merge_lora: bool = False,
) -> Path:
    """Convert a moerl Megatron checkpoint back to a HF directory that transformers and SGLang load.

    A checkpoint trained with LoRA converts with ``merge_lora`` (the full model with every adapter's update
    folded in), or to an adapter directory with :func:`export_adapter_dir`."""
    mcore_dir, out = Path(mcore_dir), Path(out_dir)
    meta, family, cfg, lora_cfg = _read_checkpoint(mcore_dir)
    dtype = MODEL_DTYPES[meta["dtype"]]
    if lora_cfg is None and merge_lora:
        raise CheckpointError(
            f"{mcore_dir} holds no LoRA adapters (no lora section in its {TRAINER_STATE}); convert it without "
            "--merge-lora"
        )
    if lora_cfg is not None and not merge_lora:
        raise CheckpointError(
            f"{mcore_dir} was trained with LoRA: pass --adapter-only --adapter-format peft|sglang (the adapter) "
            "or --merge-lora (merged full weights)"
        )
    with _staging_dir(out) as staging:
        model = _meta_model(cfg, dtype, lora_cfg)
        params = dict(model.named_parameters())
        writer = HFWriter(staging, max_shard_bytes)
        for prefix, rules in tqdm(family.weight_layers(cfg), desc="mcore-to-hf", unit="layer", disable=not progress):
            names = [rule.mcore for rule in rules]
            names += [n for n in params if is_lora_param(n) and in_layer(n, prefix)]
            for name in names:
                _set_param(model, name, torch.empty_like(params[name], device="cpu"))
            sharded = model.sharded_state_dict(metadata=SHARDED_METADATA)
            state = load_sharded({n: t for n, t in sharded.items() if in_layer(n, prefix)}, mcore_dir)
            for rule in rules:
                weight, module = state[rule.mcore], rule.mcore.removesuffix(".weight")
                if f"{module}.lora_A" in state:
                    assert lora_cfg is not None, "a model is built with adapters only from a LoRA config"
                    weight = merge_into(weight, state[f"{module}.lora_A"], state[f"{module}.lora_B"], lora_cfg.scale)
                for name, tensor in zip(rule.hf, family.to_hf(rule, weight, cfg), strict=True):
                    writer.add(name, tensor)
            for name in names:
                _set_param(model, name, torch.empty_like(params[name], device="meta"))
        writer.close()
        copy_carried_files(mcore_dir / HF_SUBDIR, staging)
    return out
