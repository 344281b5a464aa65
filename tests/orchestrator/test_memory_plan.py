"""The memory plan's terms for the largest micro-batch and the weight sync's communicators: each term that the CPU can
show is checked against the bytes the real code allocates for it, counted tensor by tensor on a gloo rank."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moerl.megatron.launch import run_ranks
from tests.test_gpu_path import QWEN3_30B, REPO, _plan

GIB = 1 << 30


class PeakBytes(TorchDispatchMode):
    """The bytes of the tensor storages made under it, at their peak: a storage counts from the op that makes it until
    it is freed (torch keeps one Python object per storage, which dies with it). Deterministic, unlike the process's
    resident memory, which the allocator's caching and the OS blur."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.storages = 0, 0, set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.storages.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self.storages:  # not a view or an in-place op's output
                    self.storages.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, nbytes)
        return out


LOGITS_MODEL = dict(
    vocab_size=8192, hidden_size=32, num_hidden_layers=1, mlp_only_layers=[], max_position_embeddings=256
)
ROWS, WIDTH = 2, 256  # the measured micro-batch: two responses of 256 tokens after a one-token prompt


def logits_peaks(cases: list[tuple[bool, bool, bool]]) -> list[int]:
    """On a rank: per (sampling_mask, entropy, a distillation's top-k term) case, the peak bytes of the trainer's logits
    path in bf16, from the hidden states onwards: megatron-core's output layer (fp32, as the trainer sets it) and
    GPTModel's post-processing, the trainer's scores of the response tokens, the loss and its backward."""
    from types import SimpleNamespace

    from moerl.layout import Layout
    from moerl.megatron.model import build_model
    from moerl.megatron.parallel import init_distributed
    from moerl.models.tiny import TINY_QWEN3
    from moerl.sample import Sample
    from moerl.trainer.batch import build_micro_batch
    from moerl.trainer.logprobs import entropy
    from moerl.trainer.trainer import Trainer, _fp32_output_layer, _topk_kl

    init_distributed(Layout())
    config = dict(TINY_QWEN3, **LOGITS_MODEL, architectures=["Qwen3MoeForCausalLM"])
    model = build_model(config, Layout(), torch.bfloat16)
    _fp32_output_layer(model)
    model.train()
    rng = np.random.default_rng(0)
    vocab, peaks = LOGITS_MODEL["vocab_size"], []
    for sampling_mask, with_entropy, top_k in cases:
        samples = []
        for _ in range(ROWS):
            ids = rng.integers(0, vocab, WIDTH).astype(np.int32)
            kept = np.stack([ids, (ids + 1) % vocab], 1).reshape(-1).astype(np.int32)  # two ids a token
            zeros = np.zeros(WIDTH, np.float32)
            samples.append(
                Sample(
                    prompt_ids=np.ones(1, np.int32),
                    response_ids=ids,
                    behaviour_logprobs=zeros,
                    versions=np.zeros(WIDTH, np.int64),
                    selected_logprobs=zeros,
                    mask_offsets=np.arange(WIDTH + 1, dtype=np.int64) * 2,
                    mask_ids=kept,
                    teacher_logprobs=zeros,
                    teacher_selected_logprobs=zeros,
                    teacher_top_ids=rng.integers(0, vocab, (WIDTH, 4)).astype(np.int32),
                    teacher_top_logprobs=np.full((WIDTH, 4), -1.0, np.float32),
                )
            )
        mb = build_micro_batch(
            samples,
            [1.0] * ROWS,
            [1.0] * ROWS,
            multiple=1,
            use_masks=sampling_mask,
            routed_experts=None,
            teacher_top_k=4 if top_k else None,
        )
        trainer = SimpleNamespace(cfg=SimpleNamespace(replay=SimpleNamespace(sampling_mask=sampling_mask)))
        hidden = torch.randn(WIDTH, ROWS, LOGITS_MODEL["hidden_size"], dtype=torch.bfloat16, requires_grad=True)
        with PeakBytes() as counted:
            logits = model._postprocess(hidden, None, None, None, None, None, None)
            new, rows = Trainer._scores(trainer, logits, mb)
            loss = (mb.weights * new).sum()
            if with_entropy:
                loss = loss - (mb.weights * entropy(rows)).sum()
            if top_k:
                loss = loss + (mb.weights * _topk_kl(rows, mb)).sum()
            del logits, new, rows  # as the schedule lets go of them: only autograd holds them now
            loss.backward()
        peaks.append(counted.peak)
    return peaks


ATTENTION_MODEL = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
SEQ = 512


def attention_peaks(cases: list[tuple[str, int]]) -> list[int]:
    """On a rank: per (dtype, layers) case, the peak bytes of ``layers`` of megatron-core's local attention
    (DotProductAttention, as the local layer spec builds it for a padded micro-batch), run forward one after another
    and then backward, on one row of ``SEQ`` tokens."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from moerl.layout import Layout
    from moerl.megatron.parallel import init_distributed
    from moerl.models import family_for
    from moerl.models.tiny import TINY_QWEN3

    init_distributed(Layout())
    cfg = dict(TINY_QWEN3, **ATTENTION_MODEL, architectures=["Qwen3MoeForCausalLM"])
    family = family_for(cfg)
    heads, groups, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    peaks = []
    for dtype_name, layers in cases:
        dtype = getattr(torch, dtype_name)
        config = family.transformer_config(cfg, Layout(), dtype)
        attention = [
            DotProductAttention(config, layer_number=i + 1, attn_mask_type=AttnMaskType.causal, attention_type="self")
            for i in range(layers)
        ]
        query = torch.randn(SEQ, 1, heads, dim, dtype=dtype, requires_grad=True)
        key, value = (torch.randn(SEQ, 1, groups, dim, dtype=dtype, requires_grad=True) for _ in range(2))
        with PeakBytes() as counted:
            out = query
            for layer in attention:
                out = layer(out, key, value, None).view(SEQ, 1, heads, dim)
            out.float().sum().backward()
        peaks.append(counted.peak)
    return peaks


def _tiny_plan(model: dict, *overrides: str):
    from moerl.models.tiny import TINY_QWEN3
    from moerl.orchestrator import memory
    from moerl.orchestrator.config import load_config

    cfg = load_config(None, ["trainer.dtype=bfloat16", "rollout.max_new_tokens=64", *overrides])
    return memory.plan(cfg, dict(TINY_QWEN3, **model, architectures=["Qwen3MoeForCausalLM"]), 1, 80.0)


LOGITS_CASES = [
    (True, False, False),
    (False, False, False),
    (True, True, False),
    (False, True, False),
    (True, False, True),
]


@pytest.fixture(scope="module")
def measured_logits() -> dict:
    return dict(zip(LOGITS_CASES, run_ranks(logits_peaks, 1, LOGITS_CASES)[0], strict=True))


@pytest.mark.e2e
@pytest.mark.parametrize("sampling_mask, with_entropy, top_k", LOGITS_CASES)
def test_the_logits_term_is_what_the_logits_path_allocates(measured_logits, sampling_mask, with_entropy, top_k):
    """3 fp32 copies of [tokens, V/tp] over the kept sets (the output layer's, GPTModel's transposed one, the response
    rows divided by their temperature), 4 over the full vocabulary, 3 more with the entropy, 1 more with a
    distillation's top-k term; within 5% of the peak the path reaches (the plan also counts the output layer's fp32
    weight copy's gradient, made once the logits are gone)."""
    plan = _tiny_plan(
        LOGITS_MODEL,
        f"trainer.micro_batch_tokens={ROWS * WIDTH}",
        f"trainer.replay.sampling_mask={str(sampling_mask).lower()}",
        f"trainer.loss.entropy_coef={0.01 * with_entropy}",
        *(["teacher.model=demo", "trainer.loss.distill.top_k=4", "trainer.loss.distill.top_k_coef=1"] if top_k else []),
    )
    assert plan.micro_batch.tokens == ROWS * WIDTH  # the sample is capped by the context, 256
    assert plan.micro_batch.logits_copies == 3 + (not sampling_mask) + 3 * with_entropy + top_k
    measured = measured_logits[(sampling_mask, with_entropy, top_k)]
    assert measured <= plan.trainer.terms["logits (fp32)"] <= 1.05 * measured


ATTENTION_CASES = [(dtype, layers) for dtype in ("bfloat16", "float32") for layers in (1, 3)]


@pytest.fixture(scope="module")
def measured_attention() -> dict:
    return dict(zip(ATTENTION_CASES, run_ranks(attention_peaks, 1, ATTENTION_CASES)[0], strict=True))


@pytest.mark.e2e
@pytest.mark.parametrize("dtype, layers", ATTENTION_CASES)
def test_the_attention_scores_term_is_what_local_attention_allocates(measured_attention, dtype, layers):
    """megatron-core's local attention (LoRA's, a padded micro-batch) at a [1, 4 heads, 512, 512] shape: the plan's
    s x s term for a stage of ``layers`` layers without recompute, and with recompute (one layer's at a time) for one
    layer's, is within 5% below the measured peak (the query, key and value sized tensors, counted with the activations,
    are in it too) and 20% above. The plan adds megatron-core's per-layer causal masks as a GPU builds them (fp32, then
    bool); on the CPU one cached bool mask stands in, so the terms run higher."""
    for recompute, measured_layers in ((False, layers), (True, 1)):
        plan = _tiny_plan(
            dict(ATTENTION_MODEL, num_hidden_layers=layers),
            "lora.enabled=true",
            f"trainer.dtype={dtype}",
            f"trainer.micro_batch_tokens={SEQ}",
            "trainer.micro_batch_format=padded",
            f"trainer.recompute={str(recompute).lower()}",
        )
        assert plan.micro_batch.attention == "local" and (plan.micro_batch.tokens, plan.micro_batch.width) == (SEQ, SEQ)
        measured = measured_attention[(dtype, measured_layers)]
        assert 0.95 * measured <= plan.trainer.terms["attention scores (s x s)"] <= 1.2 * measured


def test_transformer_engine_attention_has_no_scores_term_and_lora_or_a_gpu_without_it_has(monkeypatch):
    """The trainer builds megatron-core's local layers for LoRA, and on a GPU where Transformer Engine is not usable; a
    plan made without CUDA takes full fine-tuning to run on Transformer Engine's attention. On the local layers a
    padded micro-batch materialises the scores, a packed one does not."""
    from moerl.models import qwen_moe
    from moerl.orchestrator import memory
    from moerl.orchestrator.config import load_config

    full, lora = _plan(), _plan("lora.enabled=true", "sync.method=disk", "trainer.micro_batch_format=padded")
    assert "attention scores (s x s)" not in full.trainer.terms
    assert "Transformer Engine's (no s x s scores)" in full.table()
    assert lora.trainer.terms["attention scores (s x s)"] > 20 * GIB  # 16 heads a TP rank, 16,384 x 6,144 tokens a head
    assert "megatron-core's local attention" in lora.table()
    # packed rows go to FlexAttention on the local layers: block-sparse, no s x s scores
    packed = _plan("lora.enabled=true", "sync.method=disk", "trainer.micro_batch_format=packed")
    assert "attention scores (s x s)" not in packed.trainer.terms and "FlexAttention" in packed.table()
    # what it keeps instead: its padded rows of queries, keys, values and output, a few percent of the scores
    rows = packed.trainer.terms["attention rows (FlexAttention)"]
    assert 0 < rows < lora.trainer.terms["attention scores (s x s)"] / 20
    cfg = load_config(REPO / "recipes" / "qwen3_30b_a3b.yaml", [f"model.path={QWEN3_30B}", "engines.urls=[]"])
    assert memory.attention_kernel(cfg) == "transformer_engine"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(qwen_moe, "te_usable", lambda: False)
    assert memory.attention_kernel(cfg) == "local"  # the recipe's micro-batches are padded


def test_a_32k_response_is_a_micro_batch_of_its_own_and_sizes_the_terms():
    """At rollout.max_new_tokens=32768 the longest sample (the response and a prompt taken as 2,048 tokens) is 34,816
    tokens, more than the recipe's 16,384-token budget: a micro-batch of its own, by which the activations and logits
    are sized; at max_new_tokens 4096 the budget sizes them."""
    budget, long = _plan(), _plan("rollout.max_new_tokens=32768")
    assert (budget.micro_batch.tokens, long.micro_batch.tokens) == (16384, 34816)
    assert long.micro_batch.width == 34816 and budget.micro_batch.width == 6144  # padded rows: the longest sample
    activations = "activations (est.)"
    assert long.trainer.terms[activations] == pytest.approx(budget.trainer.terms[activations] * 34816 / 16384)
    vocab = 151936 / 2  # over TP2
    assert long.trainer.terms["logits (fp32)"] == 3 * 34816 * vocab * 4 + 2 * vocab * 2048 * 4


def test_an_agents_episode_is_sized_by_its_stream_budget_not_one_turn():
    """An episode's sample is its whole stream, up to rollout.max_episode_tokens, whatever one turn's max_new_tokens:
    at 32,768 episode tokens and 1,024 a turn the micro-batch, the logits and the loss inputs are an episode's, and a
    refusal names the key that bounds them."""
    turn = _plan("rollout.max_new_tokens=1024")
    episode = _plan(
        "rollout.max_new_tokens=1024",
        "rollout.agent=moerl.episodes.agents:tool_agent",
        "rollout.max_episode_tokens=32768",
    )
    assert (turn.micro_batch.longest, episode.micro_batch.longest) == (3072, 32768)
    assert episode.micro_batch.tokens == 32768 and episode.micro_batch.bound == "rollout.max_episode_tokens"
    vocab = 151936 / 2  # over TP2
    assert episode.trainer.terms["logits (fp32)"] == 3 * 32768 * vocab * 4 + 2 * vocab * 2048 * 4
    loss = "loss inputs (a step, at most)"
    assert episode.trainer.terms[loss] == pytest.approx(turn.trainer.terms[loss] * 32)
    (problem,) = episode.problems
    assert "lower trainer.micro_batch_tokens or rollout.max_episode_tokens (a sample longer" in problem, problem
    assert "longest sample 32,768 tokens (rollout.max_episode_tokens, within" in episode.table()


def test_the_30b_recipe_at_32k_responses_is_refused_for_its_logits_and_fits_at_tp4():
    plan = _plan("rollout.max_new_tokens=32768")
    assert 84 * GIB < plan.trainer.total < 85 * GIB  # it was 60.3 GiB: micro_batch_tokens alone, two logits copies
    (problem,) = plan.problems
    assert "the largest term is logits (fp32) at 30.7 GiB" in problem and "raise trainer.tp" in problem
    assert "(a sample longer than trainer.micro_batch_tokens is a micro-batch of its own)" in problem
    wider = _plan("rollout.max_new_tokens=32768", "trainer.tp=4", "run.trainer_ranks=32")
    assert not wider.problems and wider.trainer.total < 55 * GIB


def test_the_weight_sync_communicators_are_an_engine_term():
    """Each sender (the recipe's 8 expert-parallel ranks of its one stage) forms a group with every engine GPU, again
    after each failed push: 8 x (1 + 3) communicators of 256 MiB, outside mem_fraction_static."""
    from moerl.orchestrator.memory import MAX_GROUPS_PER_ENGINE
    from moerl.orchestrator.placement import COMMUNICATOR_BYTES

    assert COMMUNICATOR_BYTES == 256 << 20 and MAX_GROUPS_PER_ENGINE == 4
    plan = _plan()
    assert (plan.senders, plan.communicators) == (8, 8 * GIB)
    assert (
        "weight-sync communicators 8.0 GiB, outside mem_fraction_static: 8 sender(s) x 4 groups x 256 MiB"
        in plan.table()
    )
    staged = _plan("trainer.pp=2", "run.trainer_ranks=32")
    assert staged.senders == 16
    disk = _plan("sync.method=disk")
    assert disk.communicators == 0 and "communicators" not in disk.table()


def test_engines_refuse_communicators_that_do_not_fit():
    """Beside mem_fraction_static: the plan says how far to lower it (the KV cache of one group still fits down to
    weights and that floor); past the device: weights, the KV floor and the communicators together."""
    tight = _plan("engines.mem_fraction_static=0.92")
    (problem,) = tight.problems
    assert "8.0 GiB of weight-sync communicators (8 senders x 4 groups) do not fit" in problem
    assert "lower it to at most 0.90 (one group's KV cache fits down to 0.37)" in problem
    # 6 stages x 8 expert-parallel ranks send: 48 GiB of communicators beside 28.4 GiB of weights and a 12 GiB KV floor.
    many = _plan("trainer.pp=6", "run.trainer_ranks=96", "rollout.max_new_tokens=32768")
    (problem,) = [p for p in many.problems if "engine GPU" in p]
    assert problem.startswith("an engine GPU needs 88.4 GiB of 80 GiB")
    assert "48.0 GiB of weight-sync communicators" in problem and "sync.method=disk" in problem
    given = _plan("engines.mem_fraction_static=0.92", "engines.urls=[http://node3:30000]")  # engines elsewhere: theirs
    assert not given.problems and "weight-sync communicators 8.0 GiB" in given.table()


ONE_NODE = "recipes/qwen3_30b_a3b_one_node.yaml"


def test_the_one_node_recipe_fits_colocated_with_each_phase_and_the_host_memory_named():
    """Qwen3-30B-A3B full fine-tuning on one 8 x H100 node: at TP2 x EP4 a rank's training needs 108 GiB with Adam's
    state on the GPU; in host memory (trainer.optim.cpu_offload) it fits, and per GPU the engines' phase and the
    handover fit beside what stays resident. Host memory holds each rank's optimizer state and, while the engines run,
    its weights."""
    plan = _plan(config=ONE_NODE)
    assert not plan.problems and plan.colocated is not None
    assert plan.trainer.total < 0.9 * 80 * GIB and "optimizer state" not in plan.trainer.terms
    assert set(plan.host) == {"optimizer state", "weights"} and plan.host["weights"] == plan.trainer.terms["weights"]
    assert plan.senders == 0 and plan.communicators == 0  # the handover forms no weight groups
    assert plan.colocated.engines < 80 * GIB and plan.colocated.push < plan.colocated.engines
    table = plan.table()
    for line in ("released engine (assumed)", "engines generate", "weight handover", "host memory per node: 460.9 GiB"):
        assert line in table, line
    (problem,) = _plan("trainer.optim.cpu_offload=false", config=ONE_NODE).problems
    assert "the largest term is optimizer state at 42.7 GiB" in problem and "trainer.optim.cpu_offload=true" in problem


def test_colocated_engines_are_refused_past_the_gpus_they_share_or_the_memory_left_them():
    crowded = _plan("engines.replicas=8", config=ONE_NODE)
    assert any("colocated engines take 8 x 2 GPUs, more than the 8 trainer ranks' GPUs" in p for p in crowded.problems)
    (greedy,) = _plan("engines.mem_fraction_static=0.99", config=ONE_NODE).problems
    assert "lower engines.mem_fraction_static to at most 0.97" in greedy
    # Unsharded engines hold 56.9 GiB a GPU: beside the trainer's 14.9 GiB, the resident part and an 8 GiB bucket, the
    # handover no longer fits.
    unsharded = ("engines.gpus_per_replica=1", "engines.replicas=8", "sync.bucket_mb=8192")
    (heavy,) = _plan(*unsharded, config=ONE_NODE).problems
    assert heavy.startswith("the colocated weight handover needs 84.6 GiB of a 80.0 GiB GPU"), heavy


def test_colocated_reward_replicas_share_the_trainers_gpus_and_are_released_as_the_policys_engines():
    """Colocated, the job's reward replicas take no GPUs of their own: their static memory joins the engines' phase, a
    released one adds its assumed remainder to the trainer's phase and the handover, and its weights must fit in its
    fraction of what the policy's engines leave."""
    import json

    from moerl.orchestrator import memory
    from moerl.orchestrator.config import load_config
    from moerl.orchestrator.placement import RELEASED_ENGINE_BYTES
    from moerl.orchestrator.preflight import trainer_world_size

    def plan(*overrides: str) -> memory.MemoryPlan:
        cfg = load_config(REPO / ONE_NODE, [f"model.path={QWEN3_30B}", "engines.urls=[]", *overrides])
        mc = json.loads((QWEN3_30B / "config.json").read_text())
        return memory.plan(cfg, mc, trainer_world_size(cfg), 80.0, {"reward": 1_500_000_000, "teacher": 10**9})

    alone, beside = _plan(config=ONE_NODE), plan("reward.model=/models/rm", "reward.engines.mem_fraction_static=0.5")
    (scorer,) = beside.scorers
    assert beside.scorer_gpus == 0 and scorer.weights == 3e9 and not beside.problems
    assert beside.colocated is not None and alone.colocated is not None
    # SGLang's fraction is of what is free when it starts: beside the policy's engines and the trainer's resident part
    left = alone.device_bytes - alone.colocated.engines
    assert beside.colocated.engines == pytest.approx(alone.colocated.engines + 0.5 * left)
    assert beside.colocated.push == alone.colocated.push + RELEASED_ENGINE_BYTES
    assert beside.trainer.terms["released engine (assumed)"] == 2 * RELEASED_ENGINE_BYTES
    assert "reward engine GPU: weights 2.8 GiB, static" in beside.table()
    assert "on the trainer's GPUs, released while it trains" in beside.table()
    # every reward GPU's weights wait in host memory while released (--enable-weights-cpu-backup)
    w = load_config(None, ["reward.model=/models/rm"]).reward.engines
    assert beside.colocated.scorer_backup == 3e9 * w.replicas * w.gpus_per_replica
    assert alone.colocated.scorer_backup == 0
    node = sum(beside.host.values()) * beside.colocated.ranks + beside.colocated.scorer_backup
    assert f"host memory per node: {node / 2**30:.1f} GiB (8 ranks, and " in beside.table()
    (scant,) = plan("reward.model=/models/rm", "reward.engines.mem_fraction_static=0.1").problems
    assert f"more than reward.engines.mem_fraction_static=0.1 of the {left / GIB:.1f} GiB the engines started" in scant
    crowded = plan("reward.model=/models/rm", "reward.engines.mem_fraction_static=0.5", "reward.engines.replicas=9")
    assert any("colocated reward engines take 9 x 1 GPUs, more than the 8" in p for p in crowded.problems)
    # a teacher starts after the reward model's replicas, in what they leave, and is released and backed up alike
    both = plan(
        "reward.model=/models/rm",
        "reward.engines.mem_fraction_static=0.5",
        "teacher.model=/models/teacher",
        "teacher.engines.mem_fraction_static=0.5",
        "trainer.loss.distill.coef=1",
    )
    reward, teacher = both.scorers
    assert (reward.scorer.key, teacher.scorer.key) == ("reward", "teacher") and not both.problems
    assert teacher.weights == 2e9 and teacher.static == pytest.approx(0.5 * (left - reward.static))
    assert both.colocated is not None and both.colocated.engines == pytest.approx(
        alone.colocated.engines + reward.static + teacher.static
    )
    assert both.trainer.terms["released engine (assumed)"] == 3 * RELEASED_ENGINE_BYTES
    assert both.colocated.scorer_backup == 3e9 + 2e9


def test_bf16_moments_shrink_the_optimizer_state_to_two_thirds():
    """Training in bf16, Adam holds fp32 master weights (4 bytes a parameter) and two moments: 12 bytes in fp32
    moments, 8 in bf16 ones."""
    fp32, bf16 = _plan(), _plan("trainer.optim.moments_dtype=bfloat16")
    assert bf16.trainer.terms["optimizer state"] == pytest.approx(fp32.trainer.terms["optimizer state"] * 8 / 12)


def test_reward_replicas_take_gpus_of_their_own_and_a_reward_model_too_large_for_one_is_refused(tmp_path):
    """reward.model: its replicas' GPUs and weights per GPU are in the plan (read from its tensors); weights past
    reward.engines.mem_fraction_static are refused naming the key that shards them; replicas given by URL are not
    this job's to place."""
    from safetensors.torch import load_file

    from moerl.models.tiny import TINY_QWEN3, save_tiny_hf
    from moerl.orchestrator import memory
    from moerl.orchestrator.config import load_config
    from moerl.orchestrator.preflight import memory_plan

    reward = save_tiny_hf("Qwen3ForSequenceClassification", tmp_path / "rm")
    cfg = load_config(None, [f"reward.model={reward}", "reward.engines.replicas=2", "reward.engines.dtype=float32"])
    plan = memory_plan(cfg, 1, checked=True)
    params = sum(t.numel() for t in load_file(reward / "model.safetensors").values())
    (scorer,) = plan.scorers
    assert plan.scorer_gpus == 2 and scorer.weights == 4 * params
    assert f"reward engine GPU: weights {scorer.weights / (1 << 20):.1f} MiB, static" in plan.table()
    assert "2 GPU(s) of their own" in plan.table()
    demo = memory_plan(load_config(None, ["reward.model=demo", "reward.engines.dtype=float32"]), 1, checked=True)
    assert demo.scorers[0].weights == 4 * params  # reward.model=demo is made after the plan: counted from its config

    policy = dict(TINY_QWEN3, architectures=["Qwen3MoeForCausalLM"])

    def planned(*overrides: str) -> memory.MemoryPlan:  # an 8B reward model in bf16 on 16 GiB GPUs
        cfg = load_config(None, [f"reward.model={reward}", *overrides])
        return memory.plan(cfg, policy, 1, 16.0, {"reward": 8 << 30})

    assert planned().problems == [
        "a reward engine GPU holds 16.0 GiB of weights, more than reward.engines.mem_fraction_static=0.7 of 16 GiB: "
        "raise reward.engines.gpus_per_replica (tensor parallelism)"
    ]
    assert planned("reward.engines.server=sglang", "reward.engines.gpus_per_replica=2").problems == []
    given = planned("reward.engines.urls=[http://10.0.0.9:30000]")
    assert given.problems == [] and given.scorer_gpus == 0 and "reward engine" not in given.table()


def test_an_engines_kv_tokens_are_planned_as_given_and_refused_where_they_do_not_fit():
    """engines.kv_tokens (SGLang's --max-total-tokens; on the CPU 16384 by default) is the KV cache the plan counts;
    fewer than one group's completions, or more than mem_fraction_static leaves beside the weights, is refused naming
    it."""
    given = _tiny_plan({}, "engines.kv_tokens=4096")
    assert given.engine_kv_tokens == 4096 and not given.problems and "KV cache for 4,096 tokens" in given.table()
    assert _tiny_plan({}).engine_kv_tokens > 10**6  # sized from mem_fraction_static
    (few,) = _tiny_plan({}, "engines.kv_tokens=100").problems
    assert "fewer than one group's completions" in few and "engines.kv_tokens" in few
    (many,) = _tiny_plan({}, "engines.kv_tokens=10000000000").problems
    assert many.startswith("engines.kv_tokens=10,000,000,000 takes") and "GiB of KV cache" in many


def test_fp8_engines_hold_about_half_the_weights_and_their_tp_shares_must_be_whole_blocks():
    """Qwen3-30B-A3B in FP8: a byte per projection weight and a 4-byte scale per 128 x 128 block; the router, norms,
    embeddings and lm_head stay bf16. A replica of tp 4 would split the experts' 768 columns into 192: refused."""
    bf16, fp8 = _plan(), _plan("engines.quantization=fp8")
    assert 0.5 < fp8.engine_weights / bf16.engine_weights < 0.53
    assert fp8.engine_kv_tokens > bf16.engine_kv_tokens  # the memory given back holds KV cache
    wide = _plan("engines.quantization=fp8", "engines.gpus_per_replica=4")
    assert any(
        "engines.quantization=fp8 with engines.gpus_per_replica=4" in p and "experts.0.gate_proj" in p
        for p in wide.problems
    )
    assert not _plan("engines.quantization=fp8", "engines.gpus_per_replica=2").problems


def test_delta_pushes_keep_the_pushed_policy_on_global_rank_0s_host_and_form_no_groups():
    plan = _plan("sync.delta=true")
    assert plan.senders == 0 and plan.communicators == 0
    # the whole policy as pushed (the recipe's replicas are TP 2: an engine GPU holds half)
    assert plan.host["delta pushes' last policy (global rank 0 only)"] == pytest.approx(2 * plan.engine_weights)
