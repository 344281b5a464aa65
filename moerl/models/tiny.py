"""Tiny random Qwen MoE models built with transformers' own classes, for tests and the CPU demo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_QWEN3 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    decoder_sparse_step=1,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
)

# The demo models' change to TINY_QWEN3: every layer sparse. SGLang 0.5.23 builds every Qwen3-MoE layer sparse whatever
# mlp_only_layers says (moerl.engines.sglang.served_wrong), and the demos run on SGLang as on the embedded engine.
ALL_SPARSE: dict[str, Any] = {"mlp_only_layers": []}

# Qwen2-MoE's differences: shared experts and their gate, dense layers by sparse step, tied embeddings.
TINY_QWEN2 = {k: v for k, v in TINY_QWEN3.items() if k not in ("head_dim", "mlp_only_layers")} | dict(
    shared_expert_intermediate_size=48,
    norm_topk_prob=False,
    decoder_sparse_step=2,
    tie_word_embeddings=True,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
)


TINY_QWEN3_REWARD: dict[str, object] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    num_labels=1,
)

# A process reward model: the reward model's body with a head on every token, 2 labels (Qwen2.5-Math-PRM's: the score
# of a step is p(label 1) at its separator). transformers' token classifier head has a bias (token_classification_bias).
TINY_QWEN3_PRM: dict[str, object] = TINY_QWEN3_REWARD | {"num_labels": 2}


def _tiny(architecture: str, **overrides):
    """The transformers class of ``architecture`` and its tiny config."""
    from transformers import (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForSequenceClassification,
        Qwen3ForTokenClassification,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes = {
        "Qwen3MoeForCausalLM": (Qwen3MoeConfig, Qwen3MoeForCausalLM, TINY_QWEN3),
        "Qwen2MoeForCausalLM": (Qwen2MoeConfig, Qwen2MoeForCausalLM, TINY_QWEN2),
        # a reward model: one score a sequence, from its last token
        "Qwen3ForSequenceClassification": (Qwen3Config, Qwen3ForSequenceClassification, TINY_QWEN3_REWARD),
        # a process reward model: a score at every token, read at each step's separator
        "Qwen3ForTokenClassification": (Qwen3Config, Qwen3ForTokenClassification, TINY_QWEN3_PRM),
    }
    config_cls, model_cls, base = classes[architecture]
    config = config_cls(**{**base, **overrides})
    config.architectures = [architecture]
    return model_cls, config


def tiny_param_count(architecture: str, **overrides) -> int:
    """How many parameters :func:`save_tiny_hf` saves for ``architecture`` (its config changed by ``overrides``; a
    sequence classifier's ``score.bias`` included, see :func:`save_model`; a token classifier's is a parameter of its
    own), counted without making its weights."""
    model_cls, config = _tiny(architecture, **overrides)
    with torch.device("meta"):
        count = sum(p.numel() for p in model_cls(config).parameters())
    return count + (config.num_labels if architecture.endswith("ForSequenceClassification") else 0)


def tiny_hf_model(architecture: str, seed: int = 0, **overrides):
    """A randomly initialised transformers model of the given architecture (fp32, eval mode).

    Weights are drawn with a larger std than transformers' default so routing and logits are far
    from uniform and a wrong mapping cannot hide.
    """
    model_cls, config = _tiny(architecture, **overrides)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
# Qwen's tool and reasoning markers: added tokens that are not special (decoding keeps them), one id each, as in
# Qwen2.5/Qwen3, so a tool call is parsed from the same kind of token stream. Ids after the characters': the
# characters' ids stay what they were.
MARKER_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

# Qwen2.5's chat template with tools, its prose shortened to fit the tiny models' 512 positions: a system block listing
# the tools, tool calls as ``<tool_call>`` JSON in assistant turns (arguments given as a JSON string written as is, as
# Qwen3's template does), tool results as ``<tool_response>`` blocks in one user turn. No default system message.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\nCall one as <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first)
        or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def tiny_tokenizer():
    """A character-level fast tokenizer (printable ASCII and newline) that fits the tiny vocab, with Qwen's tool and
    reasoning markers as single tokens and a Qwen2.5-style chat template with tools (:data:`CHAT_TEMPLATE`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(chars))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.add_tokens(list(MARKER_TOKENS), special_tokens=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_hf(
    architecture: str, out_dir: str | Path, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """Save a tiny model with its tokenizer as a HF directory (Hub names, per-expert tensors)."""
    out = Path(out_dir)
    tokenizer = tiny_tokenizer()
    model = tiny_hf_model(
        architecture, seed=seed, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **overrides
    )
    save_model(model, out, max_shard_size)
    tokenizer.save_pretrained(out)
    return out


def save_model(model, out: str | Path, max_shard_size: str | None = None) -> None:
    """``model.save_pretrained(out)``; a sequence classifier's score head gets a zero ``score.bias`` in the
    checkpoint, which transformers' head lacks and ignores, and SGLang's has (left random without it). A token
    classifier's head has its bias in transformers already, saved as is."""
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if model.config.architectures[0].endswith("ForSequenceClassification"):
        from safetensors.torch import load_file, save_file

        path = Path(out) / "model.safetensors"
        tensors = load_file(path)
        tensors["score.bias"] = torch.zeros(model.config.num_labels)
        save_file(tensors, path, metadata={"format": "pt"})


ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
