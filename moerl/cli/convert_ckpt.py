"""``moerl convert-ckpt`` (and ``tools/convert_ckpt.py``): HF <-> Megatron checkpoint conversion and verification."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from moerl.checkpoint.peft import FORMATS
from moerl.errors import MoerlError
from moerl.layout import Layout


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert_ckpt.py",
        description="Convert Qwen3-MoE / Qwen2-MoE checkpoints between Hugging Face (Hub names, "
        "safetensors) and Megatron (megatron-core dist_checkpointing, loadable at any TP/EP/PP), "
        "and verify a conversion by comparing logits.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("hf-to-mcore", help="HF directory -> Megatron checkpoint (streams one layer at a time)")
    p.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors, single or sharded)")
    p.add_argument("--out", required=True, help="new directory for the Megatron checkpoint (must not exist)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF directory that transformers and SGLang load")
    p.add_argument("--mcore", required=True, help="Megatron checkpoint written by hf-to-mcore or the trainer")
    p.add_argument("--out", required=True, help="new directory for the HF model (must not exist)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size (default 2 GB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    lora = p.add_mutually_exclusive_group()
    lora.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA-trained checkpoint: write its adapters only, as a PEFT adapter directory (give --adapter-format)",
    )
    lora.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA-trained checkpoint: write the full model with the adapters merged into its weights",
    )
    _adapter_options(p)

    p = sub.add_parser(
        "hf-to-fp8",
        help="HF directory -> the same model as a block-wise FP8 checkpoint, which SGLang engines serve in FP8 "
        "(engines given by URL under engines.quantization=fp8)",
    )
    p.add_argument("--hf", required=True, help="HF model directory")
    p.add_argument("--out", required=True, help="new directory for the FP8 model (must not exist)")

    p = sub.add_parser("check-adapter", help="check an adapter directory against the LoRA checkpoint it came from")
    p.add_argument("--mcore", required=True, help="the LoRA-trained Megatron checkpoint")
    p.add_argument("--adapter", required=True, help="the adapter directory to check")
    _adapter_options(p)

    p = sub.add_parser("verify", help="compare logits of the HF model and the Megatron checkpoint")
    p.add_argument("--hf", required=True, help="HF model directory")
    p.add_argument("--mcore", required=True, help="Megatron checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (sequence parallel when > 1)")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: tp when ep=1, else 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument(
        "--tolerance", type=float, default=1e-3, help="max allowed |logit difference| in fp32 (default 1e-3)"
    )
    return parser


def _adapter_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--adapter-format",
        choices=FORMATS,
        default=None,
        help="the layout for the adapter's consumer: peft (PEFT over transformers, e.g. to evaluate or publish) or "
        "sglang (SGLang and moerl serve: one module per expert). Each drops parts of the other's layout.",
    )
    p.add_argument(
        "--base-model",
        default=None,
        help="the base model the adapter's config names (base_model_name_or_path; default: the HF directory "
        "the checkpoint was converted from)",
    )


def _release_freed_tensors_to_the_os() -> None:
    """Serve every allocation of 64 KiB or more with its own mmap (glibc only).

    Conversion frees a layer's tensors while others (the pending output shard) stay alive; glibc
    otherwise raises its mmap threshold after the first frees and carves later tensors out of the
    heap, whose fragments it cannot return, so resident memory creeps up with every layer.
    """
    import ctypes
    import ctypes.util

    m_mmap_threshold = -3
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "mallopt"):
            libc.mallopt(m_mmap_threshold, 64 * 1024)


def _adapter_format(args) -> str:
    if args.adapter_format is None:
        raise MoerlError(
            "give --adapter-format peft (PEFT over transformers) or sglang (SGLang, moerl serve): "
            "an adapter in one consumer's layout loads with parts missing in the other"
        )
    return args.adapter_format


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "verify":
        # Conversion runs on the CPU whatever the host has; hidden before anything asks CUDA, the CPU path
        # runs in this process (elsewhere convert.py starts a fresh process for it).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        _release_freed_tensors_to_the_os()
    try:
        if args.command == "hf-to-mcore":
            from moerl.checkpoint.convert import hf_to_mcore

            out = hf_to_mcore(args.hf, args.out, progress=not args.no_progress)
            print(f"wrote Megatron checkpoint {out}")
        elif args.command == "mcore-to-hf" and args.adapter_only:
            from moerl.checkpoint.convert import export_adapter_dir

            out, dropped = export_adapter_dir(args.mcore, args.out, _adapter_format(args), args.base_model)
            print(f"wrote {args.adapter_format} adapter {out}")
            if dropped:
                print(
                    f"warning: PEFT over transformers 5 would load {len(dropped)} module(s) of this adapter into "
                    f"nothing (e.g. {dropped[0]}) and serve another model; for PEFT, export it with "
                    "--adapter-format peft",
                    file=sys.stderr,
                )
        elif args.command == "mcore-to-hf":
            from moerl.checkpoint.convert import mcore_to_hf

            out = mcore_to_hf(
                args.mcore,
                args.out,
                progress=not args.no_progress,
                max_shard_bytes=int(args.max_shard_gb * 1024**3),
                merge_lora=args.merge_lora,
            )
            print(f"wrote HF model {out}")
        elif args.command == "hf-to-fp8":
            from moerl.checkpoint.hf import save_fp8

            save_fp8(Path(args.hf), Path(args.out))  # refuses an --out that exists
            print(f"wrote FP8 model {args.out}")
        elif args.command == "check-adapter":
            from moerl.checkpoint.convert import check_adapter_dir

            problems = check_adapter_dir(args.mcore, args.adapter, _adapter_format(args), args.base_model)
            for problem in problems:
                print(f"error: {args.adapter}: {problem}", file=sys.stderr)
            if not problems:
                print(
                    f"{args.adapter}: every adapter of {args.mcore} is there, as trained ({args.adapter_format} format)"
                )
            return 1 if problems else 0
        else:
            from moerl.checkpoint.verify import verify

            layout = Layout(tp=args.tp, ep=args.ep, etp=args.etp, pp=args.pp)
            diff = verify(args.hf, args.mcore, layout)
            ok = diff <= args.tolerance
            print(
                f"verify {layout}: max |logit diff| = {diff:.3e} ({'OK' if ok else 'FAIL'}, "
                f"tolerance {args.tolerance:.1e})"
            )
            return 0 if ok else 1
    except MoerlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
