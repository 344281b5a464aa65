"""Forward and forward-backward through megatron-core's pipeline schedules, at any layout."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``. From host memory to a GPU the copy is queued from page-locked memory and the host goes
    on: a copy from pageable memory first waits for everything queued on the stream, so the host could not queue a
    micro-batch's forward before the previous one had run. The page-locked staging copy may be dropped at once: torch's
    pinned-memory allocator records the copy's stream on its block and hands the block out again only once the stream
    has passed that point."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)


@contextlib.contextmanager
def rope_at(model_chunk: torch.nn.Module, positions: torch.Tensor | None):
    """Within: ``model_chunk``'s rotary embedding rotates position ``i`` of the sequence by ``positions[i]`` (int64
    ``[s]``, on its device) rather than by ``i``: megatron-core's GPTModel reads no position ids for RoPE, so a
    response fed after other responses, yet attending to its prompt, would be rotated as far from the prompt as it is
    fed. None: as megatron-core rotates."""
    if positions is None:
        yield
        return
    rotary = next(
        r for m in model_chunk.modules() if isinstance(r := getattr(m, "rotary_pos_emb", None), torch.nn.Module)
    )
    table = rotary.forward

    def at_positions(max_seq_len: int, *args, **kwargs):
        assert max_seq_len == positions.numel(), "rope_at: one position per position of the sequence"
        return table(int(positions.max()) + 1, *args, **kwargs)[positions]

    rotary.forward = at_positions
    try:
        yield
    finally:
        del rotary.forward  # the class's own again


def run_schedule(
    model: torch.nn.Module,
    microbatches: list[Any],
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
    forward_only: bool,
    input_ids_of: Callable[[Any], torch.Tensor] = lambda item: item,
    around_forward: Callable[[Any], Any] | None = None,
    extra_inputs: Callable[[Any, torch.device], dict] | None = None,
) -> list[torch.Tensor]:
    """Run ``microbatches`` through the pipeline.

    Each item gives ``[b, s]`` token ids through ``input_ids_of``. ``loss_fn(vocab_parallel_logits
    [b, s, V/tp], item)`` gives each microbatch's scalar loss on the last stage, where the list of
    losses is returned (empty elsewhere). With ``forward_only=False`` gradients of the losses land in
    the parameters: of their sum when the model config has ``calculate_per_token_loss``, else of
    their mean. ``around_forward(item)``, if given, is a context manager entered around this stage's
    forward of the item (e.g. to set routing-replay targets and read what the routers recorded).
    ``extra_inputs(item, device)``, if given, returns model inputs replacing the defaults (positions
    counted from each row's start, causal attention), e.g. a packed micro-batch's positions and packed-sequence
    parameters; and ``rope_positions``, where RoPE must rotate each position by another than its index
    (:func:`rope_at`).
    """
    first = input_ids_of(microbatches[0])
    b, s = first.shape
    losses: list[torch.Tensor] = []
    device = next(model.parameters()).device
    one = torch.tensor(1, dtype=torch.int)

    def forward_step(data_iterator, model_chunk):
        item = next(data_iterator)
        input_ids = host_to_device(input_ids_of(item), device)
        inputs = {"position_ids": position_ids_for(input_ids), "attention_mask": None}
        if extra_inputs is not None:
            inputs.update(extra_inputs(item, device))
        positions = inputs.pop("rope_positions", None)
        with (
            rope_at(model_chunk, positions),
            around_forward(item) if around_forward is not None else contextlib.nullcontext(),
        ):
            output = model_chunk(input_ids, **inputs)

        def loss_func(logits):
            loss = loss_fn(logits, item)
            losses.append(loss.detach())
            return loss, one, {}

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
