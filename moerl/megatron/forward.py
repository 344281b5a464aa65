"""Forward and forward-backward through megatron-core's pipeline schedules, at any layout."""

from __future__ import annotations

from typing import Callable

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)


def run_schedule(
    model: torch.nn.Module,
    microbatches: list[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    forward_only: bool,
) -> list[torch.Tensor]:
    """Run ``microbatches`` (each ``[b, s]`` token ids, same shape) through the pipeline.

    ``loss_fn(vocab_parallel_logits [b, s, V/tp], input_ids)`` gives each microbatch's scalar loss on
    the last stage, where the list of losses is returned (empty elsewhere). With
    ``forward_only=False`` gradients of the sum of losses land in the parameters.
    """
    b, s = microbatches[0].shape
    losses: list[torch.Tensor] = []

    device = next(model.parameters()).device

    def forward_step(data_iterator, model_chunk):
        input_ids = next(data_iterator).to(device)
        output = model_chunk(input_ids, position_ids_for(input_ids), None)

        def loss_func(logits):
            loss = loss_fn(logits, input_ids)
            losses.append(loss.detach())
            return loss, {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=s,
        micro_batch_size=b,
        forward_only=forward_only,
    )
    return losses


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits ``[b, s, V]`` on the last pipeline stage; None on the others.

    Sequence parallelism splits the sequence across TP ranks, so it is right-padded to a multiple of
    TP; causal attention keeps the padding from touching the real positions.
    """
    captured: list[torch.Tensor] = []
    length = input_ids.shape[1]
    pad = -length % parallel_state.get_tensor_model_parallel_world_size()
    if pad:
        input_ids = torch.nn.functional.pad(input_ids, (0, pad))

    def keep(logits, _ids):
        captured.append(gather_from_tensor_model_parallel_region(logits).detach())
        return logits.new_zeros(())

    model.eval()
    with torch.no_grad():
        run_schedule(model, [input_ids], keep, forward_only=True)
    return captured[0][:, :length] if parallel_state.is_pipeline_last_stage() else None
