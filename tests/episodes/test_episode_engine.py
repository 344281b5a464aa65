"""Episodes against the embedded engine, served in the test's own event loop: the token stream, versions, kept sets
and routing across turns, forks, and the rule for prefixes the engine computed again."""

from __future__ import annotations

import asyncio

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from moerl.engines.protocol import SamplingParams
from moerl.episodes import Episode, EpisodeSettings
from tests.episodes.conftest import assert_only_seen, engine_generate, served

PROMPT = [3, 17, 42, 99, 7, 11, 12]
CONTEXT = [60, 61, 62]
PARAMS = SamplingParams(max_new_tokens=6, top_k=20, sampling_seed=1)


def expert_sets(model_dir, fed: list[int]) -> np.ndarray:
    """Each fed position's top-k experts per MoE layer, sorted, from one forward of the whole sequence."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([fed]), output_router_logits=True)
    topk = model.config.num_experts_per_tok
    routing = torch.stack([torch.topk(r.float(), topk, -1).indices for r in out.router_logits], dim=1)
    return np.sort(routing.numpy(), -1)


def test_token_level_turns_keep_the_engine_tokens_and_each_routing_row_once(models, tokenizer):
    calls = []

    async def go():
        async with served(models[0]) as client:
            await client.set_weight_version("3")
            settings = EpisodeSettings(tokenizer, PARAMS, sampling_mask=True)
            episode = Episode(PROMPT, {}, engine_generate(client, calls), settings, group_id=4, index=2)
            first = await episode.generate()
            second = await episode.generate(CONTEXT)
            return episode, first, second

    episode, first, second = asyncio.run(go())
    (sample,) = episode.samples(reward=1.0, temperature=1.0)
    c1, c2 = (c.completion for c in calls)
    assert first == c1.output_ids.tolist() and second == c2.output_ids.tolist()
    n1, n2, p = len(first), len(second), len(PROMPT)
    assert sample.prompt_ids.tolist() == PROMPT
    assert sample.response_ids.tolist() == first + CONTEXT + second
    assert sample.loss_mask.tolist() == [1] * n1 + [0] * len(CONTEXT) + [1] * n2
    assert sample.versions.tolist() == [3] * n1 + [-1] * len(CONTEXT) + [3] * n2
    assert (sample.group_id, sample.episode, sample.reward) == (4, 2, 1.0)
    np.testing.assert_array_equal(sample.behaviour_logprobs, np.concatenate([c1.logprobs, np.zeros(3), c2.logprobs]))
    np.testing.assert_array_equal(
        sample.selected_logprobs, np.concatenate([c1.sampling_logprobs, np.zeros(3), c2.sampling_logprobs])
    )
    kept = np.diff(sample.mask_offsets)
    assert kept[n1 : n1 + 3].tolist() == [0, 0, 0]
    np.testing.assert_array_equal(sample.mask_ids, np.concatenate([c1.mask_ids, c2.mask_ids]))
    # Turn 2 asked only for the rows it had not got: from the last token of turn 1 on, which its prefix cache held.
    assert [c.start for c in calls] == [0, p + n1 - 1]
    assert c2.cached_tokens == p + n1 - 1 and episode.stats.recomputed_positions == 0
    assert sample.routing.shape[0] == p + len(sample.response_ids) - 1 == len(c1.routing) + len(c2.routing)
    np.testing.assert_array_equal(sample.routing[: p + n1 - 1], c1.routing)
    np.testing.assert_array_equal(sample.routing[p + n1 - 1 :], c2.routing)
    # Row i is what position i routed to: the same expert sets as one forward of the whole stream.
    np.testing.assert_array_equal(np.sort(sample.routing, -1), expert_sets(models[0], sample.fed_ids().tolist()))
    stats = episode.stats
    assert (stats.turns, stats.model_tokens, stats.context_tokens, stats.forks) == (2, n1 + n2, 3, 0)
    # Received: each row once. Had each turn asked for its whole sequence: turn 1's rows twice.
    assert stats.routing_rows == sample.routing.shape[0]
    assert stats.full_sequence_rows == (p + n1 - 1) + sample.routing.shape[0]
    assert_only_seen(sample, calls)


def test_recomputed_prefix_keeps_the_routing_its_tokens_were_sampled_under(models, tokenizer):
    """A weight update with a cache flush between turns: turn 2's engine computes the stream again under the new
    weights; the sample keeps turn 1's rows for those positions and counts them."""
    calls = []

    async def go():
        async with served(models[0]) as client:
            await client.set_weight_version("1")
            episode = Episode(
                PROMPT, {}, engine_generate(client, calls), EpisodeSettings(tokenizer, PARAMS, sampling_mask=True)
            )
            await episode.generate()
            await client.update_weights_from_disk(str(models[1]), weight_version="2", flush_cache=True)
            await episode.generate(CONTEXT)
            return episode

    episode = asyncio.run(go())
    (sample,) = episode.samples(reward=0.0, temperature=1.0)
    c1, c2 = (c.completion for c in calls)
    start = calls[1].start
    assert c2.cached_tokens == 0
    assert episode.stats.recomputed_positions == start == len(PROMPT) + len(c1.output_ids) - 1
    np.testing.assert_array_equal(sample.routing[:start], c1.routing)
    np.testing.assert_array_equal(sample.routing[start:], c2.routing)
    # The new weights route those positions otherwise: keeping the old rows is what made the difference.
    new = expert_sets(models[1], sample.fed_ids().tolist())[:start]
    assert not np.array_equal(np.sort(sample.routing[:start], -1), new)
    n1 = len(c1.output_ids)
    assert sample.versions[:n1].tolist() == [1] * n1
    assert sample.versions[n1 + len(CONTEXT) :].tolist() == [2] * len(c2.output_ids)


def test_a_history_rendered_otherwise_forks_and_the_fork_is_trained_on_what_the_engine_saw(models, tokenizer):
    calls = []
    user = {"role": "user", "content": "Say hi."}

    async def go():
        async with served(models[0]) as client:
            await client.set_weight_version("0")
            prompt = tokenizer.apply_chat_template([user], add_generation_prompt=True)["input_ids"]
            episode = Episode(
                prompt, {}, engine_generate(client, calls, sampling_mask=False), EpisodeSettings(tokenizer, PARAMS)
            )
            reply = await episode.chat([user])
            # The client keeps its own version of the reply (as a harness that rewrites the history would).
            history = [user, {**reply, "content": "Hello there."}, {"role": "user", "content": "Again."}]
            await episode.chat(history)
            return episode, prompt, history

    episode, prompt, history = asyncio.run(go())
    first, forked = episode.samples(reward=0.5, temperature=1.0)
    assert episode.stats.forks == 1
    assert first.prompt_ids.tolist() == prompt
    rendering = tokenizer.apply_chat_template(history, add_generation_prompt=True)["input_ids"]
    assert forked.prompt_ids.tolist() == rendering
    assert forked.loss_mask.all() and forked.episode == first.episode == 0 and forked.reward == first.reward
    # The fork asked for its routing from position 0, though the engine reused the common prefix.
    assert [c.start for c in calls] == [0, 0] and calls[1].completion.cached_tokens > 0
    assert episode.stats.recomputed_positions == 0
    for sample in (first, forked):
        assert_only_seen(sample, calls)
