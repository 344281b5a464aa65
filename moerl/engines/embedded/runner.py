"""The model side of the embedded engine: a transformers causal LM, a padded batch KV cache that
requests join and leave between decode steps, and capture of every MoE router's top-k choice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from moerl.engines.embedded.prefix_cache import CachedPrefix
from moerl.engines.protocol import ProtocolError
from moerl.models import ModelFamily

DENSE_LAYER = -1  # routing placeholder for layers without a router (as SGLang-JAX documents)


@dataclass
class PrefillResult:
    last_logits: torch.Tensor  # [V]
    routing: torch.Tensor  # int32 [p, num_layers, topk]
    prompt_logprobs: torch.Tensor | None  # [p - start] log p(token_i | prefix), first entry NaN when start == 0
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [1, kv_heads, p, head_dim]


class ModelRunner:
    """Runs prefill for one request and decode steps for the running batch.

    The batch cache holds one row per running request, right-aligned: a row joining with a shorter
    history is left-padded, and an attention mask hides the padding. RoPE is applied before keys
    enter the cache, so where a key sits in the cache does not change what it means.
    """

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(self.device).eval()
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
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.mask: torch.Tensor | None = None  # [B, L] 1 where the cache holds a real token

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
    ) -> PrefillResult:
        """Prefill ``token_ids``, of which the first ``cached`` come from ``prefix`` (their KV and routing as it holds
        them); prompt log-probs from ``logprob_start`` need the logits before it, so ``cached < logprob_start``."""
        ids = torch.tensor([token_ids], device=self.device)
        cache = DynamicCache(ddp_cache_data=prefix.kv_upto(cached)) if cached else DynamicCache()
        positions = torch.arange(cached, len(token_ids), device=self.device)[None]
        out = self.model(
            input_ids=ids[:, cached:],
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if logprob_start is not None else 1,
        )
        logits = out.logits[0]
        prompt_logprobs = None
        if logprob_start is not None:
            logprobs = torch.full((len(token_ids),), float("nan"), device=self.device)  # the first token has none
            logprobs[cached + 1 :] = (
                torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, ids[0, cached + 1 :, None]).squeeze(1)
            )
            prompt_logprobs = logprobs[logprob_start:].cpu()
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        routing = self._routing(len(token_ids) - cached)
        if cached:
            routing = torch.cat([prefix.routing[:cached], routing])
        return PrefillResult(logits[-1], routing, prompt_logprobs, kv)

    def row_kv(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cache of batch row ``row``'s last ``length`` positions (its tokens: rows are right-aligned), copied out."""
        return [(k[row : row + 1, :, -length:].clone(), v[row : row + 1, :, -length:].clone()) for k, v in self.kv]

    def join(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append a prefilled request as the last batch row."""
        length = kv[0][0].shape[-2]
        row_mask = torch.ones(1, length, dtype=torch.long, device=self.device)
        if self.kv is None:
            self.kv, self.mask = list(kv), row_mask
            return
        total = max(length, self.mask.shape[1])
        pad = lambda t, n: torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t  # noqa: E731  left-pad seq dim
        self.kv = [
            (
                torch.cat([pad(k, total - k.shape[-2]), pad(nk, total - length)]),
                torch.cat([pad(v, total - v.shape[-2]), pad(nv, total - length)]),
            )
            for (k, v), (nk, nv) in zip(self.kv, kv)
        ]
        old = torch.nn.functional.pad(self.mask, (total - self.mask.shape[1], 0))
        self.mask = torch.cat([old, torch.nn.functional.pad(row_mask, (total - length, 0))])

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every batch row not in ``rows`` (in that order), then trim all-padding columns."""
        if not rows:
            self.kv = self.mask = None
            return
        index = torch.tensor(rows, device=self.device)
        mask = self.mask.index_select(0, index)
        start = int((mask.sum(0) > 0).long().argmax())
        self.mask = mask[:, start:]
        self.kv = [(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:]) for k, v in self.kv]

    @torch.no_grad()
    def decode(self, tokens: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step for every batch row: feed ``tokens[i]`` at true position ``positions[i]``.

        Returns logits [B, V] and routing int32 [B, num_layers, topk].
        """
        ids = torch.tensor(tokens, device=self.device)[:, None]
        pos = torch.tensor(positions, device=self.device)[:, None]
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        cache = DynamicCache(ddp_cache_data=self.kv)
        out = self.model(
            input_ids=ids, position_ids=pos, attention_mask=self.mask, past_key_values=cache, use_cache=True
        )
        self.kv = [(layer.keys, layer.values) for layer in cache.layers]
        return out.logits[:, -1], self._routing(len(tokens))


def moe_gates(model: torch.nn.Module, model_dir) -> dict[int, torch.nn.Module]:
    """The router of each MoE layer of a transformers MoE model, by layer index."""
    gates = {}
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "num_experts"):
            gates[i] = gate
    if not gates:
        raise ValueError(f"{model_dir}: no MoE router found; the embedded engine serves MoE models")
    return gates


def hub_tensor_view(family: ModelFamily, params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The slice of a transformers model's parameters (of ``family``) that holds the Hub tensor ``name`` (None if none)."""
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
    pairs, problems = [], []
    for name, tensor in named:
        dst = hub_tensor_view(family, params, name)
        if dst is None:
            problems.append(f"{name}: not a weight of the served model")
        elif tuple(dst.shape) != tuple(tensor.shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)} != served {tuple(dst.shape)}")
        else:
            pairs.append((dst, tensor))
    if problems:
        raise ProtocolError("weight update refused, nothing was changed: " + "; ".join(problems[:5]))
    return pairs
