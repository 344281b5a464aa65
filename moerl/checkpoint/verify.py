"""Check a Megatron checkpoint against its HF source: same prompts, max |logit difference|."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from moerl.checkpoint.mcore import hf_config_of, load_megatron_model
from moerl.layout import UNSHARDED, Layout
from moerl.megatron.forward import forward_logits
from moerl.megatron.launch import run_ranks
from moerl.models import family_for

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Question: what is 17 * 23? Answer:",
)


def prompt_ids(hf_dir: str | Path, vocab_size: int) -> list[torch.Tensor]:
    """Fixed prompts through the model's tokenizer, or seeded random ids when it ships none."""
    if (Path(hf_dir) / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        return [torch.tensor([tokenizer(p)["input_ids"]], dtype=torch.long) for p in PROMPTS]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (1, n), generator=generator) for n in (7, 13, 24)]


def _verify_rank(hf_dir: str, mcore_dir: str, layout: Layout) -> float | None:
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    cfg, model = load_megatron_model(mcore_dir, layout)
    holder = (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval() if holder else None
    worst = 0.0
    for ids in prompt_ids(hf_dir, cfg["vocab_size"]):
        logits = forward_logits(model, ids)
        if reference is not None:
            assert logits is not None, "the reference's holder is on the last pipeline stage, which has the logits"
            with torch.no_grad():
                worst = max(worst, (logits.cpu() - reference(ids).logits).abs().max().item())
    return worst if holder else None


def world_size_for(layout: Layout) -> int:
    return math.lcm(layout.tp * layout.pp, layout.etp * layout.ep * layout.pp)


def verify(hf_dir: str | Path, mcore_dir: str | Path, layout: Layout = UNSHARDED) -> float:
    """Max |logit difference| (fp32) between the HF model and the Megatron checkpoint at ``layout``.

    Under torchrun it runs as the launched ranks; otherwise it spawns the ranks the layout needs.
    """

    raw = hf_config_of(mcore_dir)
    family = family_for(raw)
    family.check_layout(family.normalize(raw), layout)
    args = (str(hf_dir), str(mcore_dir), layout)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        results = [_verify_rank(*args)]
        import torch.distributed as dist

        gathered: list[float | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results[0])
        results = gathered
    else:
        results = run_ranks(_verify_rank, world_size_for(layout), *args)
    return max(r for r in results if r is not None)
