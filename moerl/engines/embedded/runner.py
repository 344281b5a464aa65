"""The model side of the embedded engine: a transformers causal LM, a padded batch KV cache that
requests join and leave between decode steps, and capture of every MoE router's top-k choice."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

from moerl.engines.embedded.prefix_cache import KV, CachedPrefix
from moerl.engines.protocol import ProtocolError
from moerl.fp8 import FP8, SCALE_SUFFIX
from moerl.models import ModelFamily

DENSE_LAYER = -1  # routing placeholder for layers without a router (as SGLang-JAX documents)


@dataclass
class PrefillResult:
    last_logits: torch.Tensor  # [V]
    routing: torch.Tensor  # int32 [p, num_layers, topk]
    # [p - start] log p(token_i | prefix) from logprob_start, the first NaN: SGLang computes none for the token there
    prompt_logprobs: torch.Tensor | None
    kv: KV  # per layer [1, kv_heads, p, head_dim]
    # The most likely tokens in place of each prompt token after logprob_start: log-probs [p - start - 1, k] descending
    # and their ids
    prompt_top: tuple[torch.Tensor, torch.Tensor] | None = None


def own_weights(model: torch.nn.Module) -> None:
    """Give each parameter storage of its own, allocated as any later one is. Weights read from safetensors on the CPU
    are views into the file's buffer at its offsets (8-byte aligned), and the CPU's matmuls round differently on
    unaligned operands: weights freed and allocated again (a colocated release and resume) then gave log-probs a few
    ulps off for the same values."""
    with torch.no_grad():
        for param in model.parameters():
            if param.data_ptr() % 64:
                param.data = param.data.clone()


def engine_device(device: str | None) -> torch.device:
    """Where an engine computes: ``device``, else CUDA where there is one."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


class ModelRunner:
    """Runs prefill for one request and decode steps for the running batch.

    The batch cache holds one row per running request, right-aligned: a row joining with a shorter
    history is left-padded, and an attention mask hides the padding. RoPE is applied before keys
    enter the cache, so where a key sits in the cache does not change what it means.
    """

    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | None = None,
        model: PreTrainedModel | None = None,
    ):
        """Serve the HF directory ``model_dir``'s model in ``dtype``, or ``model`` (made of it elsewhere: an FP8
        checkpoint's, :class:`~moerl.engines.embedded.fp8.FP8Model`)."""
        self.device = engine_device(device)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        # transformers wraps PreTrainedModel.to with functools.wraps, whose type takes the bound self for an argument.
        self.model: PreTrainedModel = model.to(self.device).eval()  # type: ignore[arg-type]
        own_weights(self.model)
        self.model_dir = str(model_dir)
        config = self.model.config
        self.num_layers = config.num_hidden_layers
        self.topk = config.num_experts_per_tok
        self.vocab_size = config.vocab_size
        self._captured: dict[int, torch.Tensor] = {}
        gates = moe_gates(self.model, model_dir)
        for i, gate in gates.items():
            gate.register_forward_hook(self._capture_hook(i))
        self.moe_layers = list(gates)
        # The batch cache (both None while no request runs): per layer [B, kv_heads, L, head_dim], and its mask
        # [B, L], 1 where the cache holds a real token.
        self.kv: KV | None = None
        self.mask: torch.Tensor | None = None

    def _capture_hook(self, layer: int):
        def hook(module, inputs, outputs):
            self._captured[layer] = outputs[2].detach()  # router indices [tokens, topk]

        return hook

    def _routing(self, tokens: int) -> torch.Tensor:
        routing = torch.full((tokens, self.num_layers, self.topk), DENSE_LAYER, dtype=torch.int32)
        for layer in self.moe_layers:
            routing[:, layer] = self._captured[layer].to("cpu", torch.int32)
        self._captured.clear()
        return routing

    @torch.no_grad()
    def prefill(
        self,
        token_ids: list[int],
        logprob_start: int | None = None,
        cached: int = 0,
        prefix: CachedPrefix | None = None,
        top: int = 0,
    ) -> PrefillResult:
        """Prefill ``token_ids``, of which the first ``cached`` come from ``prefix`` (their KV and routing as it holds
        them); prompt log-probs from ``logprob_start`` (with each position's ``top`` most likely tokens) need the logits
        from there on, so ``cached <= logprob_start``."""
        ids = torch.tensor([token_ids], device=self.device)
        if cached:
            assert prefix is not None and prefix.routing is not None, "cached tokens come from a prefix the model made"
            cache, cached_routing = DynamicCache(ddp_cache_data=prefix.kv_upto(cached)), prefix.routing[:cached]
        else:
            cache, cached_routing = DynamicCache(), None
        positions = torch.arange(cached, len(token_ids), device=self.device)[None]
        out = self.model(
            input_ids=ids[:, cached:],
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=len(token_ids) - logprob_start if logprob_start is not None else 1,
        )
        logits = out.logits[0]  # of positions logprob_start (or the last) on
        prompt_logprobs = prompt_top = None
        if logprob_start is not None:
            assert cached <= logprob_start, "the logits from logprob_start on are computed"
            logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # of each token after logprob_start
            nan = torch.full((1,), float("nan"), device=self.device)
            prompt_logprobs = torch.cat([nan, logprobs.gather(1, ids[0, logprob_start + 1 :, None]).squeeze(1)]).cpu()
            if top:
                values, top_ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
                prompt_top = values.cpu(), top_ids.cpu()
        kv = _cache_kv(cache)
        routing = self._routing(len(token_ids) - cached)
        if cached_routing is not None:
            routing = torch.cat([cached_routing, routing])
        return PrefillResult(logits[-1], routing, prompt_logprobs, kv, prompt_top)

    def _batch(self) -> tuple[KV, torch.Tensor]:
        """The batch cache and its mask, while requests run."""
        assert self.kv is not None and self.mask is not None, "no request runs: there is no batch cache"
        return self.kv, self.mask

    def row_kv(self, row: int, length: int) -> KV:
        """The cache of batch row ``row``'s last ``length`` positions (its tokens: rows are right-aligned), copied
        out."""
        batch_kv, _ = self._batch()
        return [(k[row : row + 1, :, -length:].clone(), v[row : row + 1, :, -length:].clone()) for k, v in batch_kv]

    def join(self, kv: KV) -> None:
        """Append a prefilled request as the last batch row."""
        length = kv[0][0].shape[-2]
        row_mask = torch.ones(1, length, dtype=torch.long, device=self.device)
        if self.kv is None:
            self.kv, self.mask = list(kv), row_mask
            return
        batch_kv, mask = self._batch()
        total = max(length, mask.shape[1])
        pad = lambda t, n: torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t  # left-pads the sequence dim
        self.kv = [
            (
                torch.cat([pad(k, total - k.shape[-2]), pad(nk, total - length)]),
                torch.cat([pad(v, total - v.shape[-2]), pad(nv, total - length)]),
            )
            for (k, v), (nk, nv) in zip(batch_kv, kv, strict=True)  # the same model's layers
        ]
        old = torch.nn.functional.pad(mask, (total - mask.shape[1], 0))
        self.mask = torch.cat([old, torch.nn.functional.pad(row_mask, (total - length, 0))])

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every batch row not in ``rows`` (in that order), then trim all-padding columns."""
        if not rows:
            self.kv = self.mask = None
            return
        batch_kv, batch_mask = self._batch()
        index = torch.tensor(rows, device=self.device)
        mask = batch_mask.index_select(0, index)
        start = int((mask.sum(0) > 0).long().argmax())
        self.mask = mask[:, start:]
        self.kv = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:]) for k, v in batch_kv
        ]

    @torch.no_grad()
    def decode(self, tokens: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step for every batch row: feed ``tokens[i]`` at true position ``positions[i]``.

        Returns logits [B, V] and routing int32 [B, num_layers, topk].
        """
        ids = torch.tensor(tokens, device=self.device)[:, None]
        pos = torch.tensor(positions, device=self.device)[:, None]
        batch_kv, mask = self._batch()
        self.mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        cache = DynamicCache(ddp_cache_data=batch_kv)
        out = self.model(
            input_ids=ids, position_ids=pos, attention_mask=self.mask, past_key_values=cache, use_cache=True
        )
        self.kv = _cache_kv(cache)
        return out.logits[:, -1], self._routing(len(tokens))


def _cache_kv(cache: DynamicCache) -> KV:
    """Each layer's keys and values, as a forward left them in ``cache``: every layer of the MoE models served is an
    attention layer, which holds both once it has run."""
    kv = []
    for layer in cache.layers:
        assert isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None
        kv.append((layer.keys, layer.values))
    return kv


def moe_gates(model: torch.nn.Module, model_dir: str | Path) -> dict[int, torch.nn.Module]:
    """The router of each MoE layer of a transformers MoE model, by layer index."""
    gates = {}
    decoder_layers = model.get_submodule("model.layers")
    assert isinstance(decoder_layers, torch.nn.ModuleList)  # transformers' decoder models all hold them so
    for i, layer in enumerate(decoder_layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "num_experts"):
            gates[i] = gate
    if not gates:
        raise ValueError(f"{model_dir}: no MoE router found; the embedded engine serves MoE models")
    return gates


def hub_tensor_view(family: ModelFamily, params: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The slice of a transformers model's parameters (of ``family``) that holds the Hub tensor ``name`` (None if
    none)."""
    param_name, index = family.transformers_slot(name)
    if param_name not in params:
        return None
    dst = params[param_name].data
    if index and not index[0] < dst.shape[0]:
        return None  # an expert the model does not have
    if len(index) == 2:  # one half of a fused [gate; up] expert
        width = dst.shape[1] // 2
        return dst[index[0], index[1] * width : (index[1] + 1) * width]
    return dst[index[0]] if index else dst


def hub_tensor_targets(
    family: ModelFamily, model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, source) for each Hub-named tensor, all checked before anything is written."""
    params = dict(model.named_parameters())
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    problems: list[str] = []
    for name, tensor in named:
        dst = hub_tensor_view(family, params, name)
        if dst is None:
            fp8 = " (FP8 scales: this engine serves unquantized weights)" if name.endswith(SCALE_SUFFIX) else ""
            problems.append(f"{name}: not a weight of the served model{fp8}")
        elif tensor.dtype == FP8:
            problems.append(
                f"{name}: float8_e4m3fn, and this engine serves unquantized weights (an FP8 policy is served from an "
                "FP8 checkpoint: engines.quantization=fp8)"
            )
        else:
            add_target(name, dst, tensor, pairs, problems)
    return checked(pairs, problems)


def add_target(
    name: str,
    dst: torch.Tensor,
    tensor: torch.Tensor,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    problems: list[str],
) -> None:
    """``(dst, tensor)`` to ``pairs`` where their shapes agree, else the mismatch to ``problems``."""
    if tuple(dst.shape) != tuple(tensor.shape):
        problems.append(f"{name}: shape {tuple(tensor.shape)} != served {tuple(dst.shape)}")
    else:
        pairs.append((dst, tensor))


def checked(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], problems: list[str]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``pairs``, unless there are ``problems``: then the whole update is refused, naming the first few."""
    if problems:
        raise ProtocolError("weight update refused, nothing was changed: " + "; ".join(problems[:5]))
    return pairs
