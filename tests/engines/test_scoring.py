"""A model scoring given tokens (a teacher, the student's): /generate with no new tokens and input log-probs from the
prompt's end, answered as SGLang 0.5.23 answers it, decoded with what SGLang guarantees checked."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from moerl.engines import protocol as P
from moerl.engines.client import EngineClient
from moerl.models.tiny import save_tiny_hf
from tests.engine_server import running_server

PROMPT = [3, 17, 42, 99, 7]
IDS = PROMPT + [23, 5, 61, 200, 18, 150]  # a prompt and a response to it
TOP = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_hf("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("scoring") / "model")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with running_server(model, tmp_path_factory.mktemp("log")) as url:
        yield url


@pytest.fixture(scope="module")
def forward(model) -> torch.Tensor:
    """Transformers' log-probs of ``IDS``, fp32: row j is the distribution of the token after ``IDS[: j + 1]``."""
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([IDS])).logits[0, :-1].float(), -1)


def expected(forward: torch.Tensor, start: int) -> tuple[np.ndarray, torch.return_types.topk]:
    """The log-prob of each of ``IDS[start:]`` given the tokens before it, and the top-k in its place."""
    rows = forward[start - 1 :]
    return rows.gather(1, torch.tensor(IDS[start:])[:, None]).squeeze(1).numpy(), rows.topk(TOP, -1)


@pytest.mark.e2e
def test_scored_log_probs_are_a_forwards_with_or_without_the_prefix_cache(server, forward):
    """Each scoring call asked twice, from the prompt's end and from the first token: the log-probs and top-k are a
    transformers forward's (fp32, 1e-5), the second call from the prompt's end reusing all the prefix cache may give it
    (the tokens before the one at logprob_start_len, as SGLang)."""

    async def go():
        async with EngineClient([server]) as client:
            return [await client.token_logprobs(IDS, start, TOP) for start in (len(PROMPT), len(PROMPT), 1, 1)]

    completions = asyncio.run(go())
    assert [c.cached_tokens for c in completions] == [0, len(PROMPT) - 1, 0, 0]
    for start, completion in zip((len(PROMPT), len(PROMPT), 1, 1), completions, strict=True):
        logprobs, top = expected(forward, start)
        assert completion.input_logprobs is not None and completion.input_logprobs.shape == (len(IDS) - start,)
        np.testing.assert_allclose(completion.input_logprobs, logprobs, atol=1e-5)
        assert np.array_equal(completion.input_top_ids, top.indices.numpy())
        np.testing.assert_allclose(completion.input_top_logprobs, top.values.numpy(), atol=1e-5)
        assert len(completion.output_ids) == 0 and completion.finish_reason["type"] == "length"


@pytest.mark.e2e
def test_input_log_probs_come_in_sglangs_shape_never_temperature_scaled(server, forward):
    """With new tokens sampled at temperature 0.5 and logprob_start_len inside the prompt: one entry per prompt token
    from there, the first null (SGLang computes none for it, whatever logprob_start_len is), the others the forward's
    unscaled log-probs; the top-k entries alike; the answer within ``largest_answer_bytes``."""
    start = 4
    request = P.GenerateReqInput(
        input_ids=IDS,
        sampling_params=P.SamplingParams(temperature=0.5, max_new_tokens=2, ignore_eos=True),
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=TOP,
        extra_key="raw",  # reuses nothing the other tests' calls left
    )

    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.post(server + "/generate", json=request.body()) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.read()

    body = asyncio.run(go())
    meta = json.loads(body)["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == IDS[start:]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert len(meta["input_top_logprobs"]) == len(IDS) - start and len(meta["output_top_logprobs"]) == 2
    (completion,) = P.decode_generate_body(body, None, scored=P.scored_ids(request))
    logprobs, top = expected(forward, start + 1)
    np.testing.assert_allclose(completion.input_logprobs, logprobs, atol=1e-5)
    assert np.array_equal(completion.input_top_ids, top.indices.numpy())
    assert len(body) <= P.largest_answer_bytes(request, None)


def _answer(entries: list, top: list | None = None, finish: str = "length") -> P.GenerateResponse:
    meta = {"id": "r", "prompt_tokens": 4, "finish_reason": {"type": finish}, "input_token_logprobs": entries}
    if top is not None:
        meta["input_top_logprobs"] = top
    return {"text": "", "output_ids": [], "meta_info": meta}


SCORED = [7, 8, 9]
GOOD = [[None, 7, None], [-1.5, 8, None], [-0.5, 9, None]]
GOOD_TOP = [None, [[-0.25, 2, None], [-1.5, 8, None]], [[-0.5, 9, None], [-1.0, 4, None]]]


def test_an_answer_as_sglang_gives_it_decodes():
    completion = P.decode_generate(_answer(GOOD, GOOD_TOP), None, scored=SCORED)
    assert completion.input_logprobs.tolist() == [-1.5, -0.5]
    assert completion.input_top_ids.tolist() == [[2, 8], [9, 4]]
    assert completion.input_top_logprobs.tolist() == [[-0.25, -1.5], [-0.5, -1.0]]
    # SGLang 0.5.23 names the vocabulary's last id 0
    assert P.decode_generate(_answer([*GOOD[:2], [-0.5, 0, None]]), None, scored=SCORED).input_logprobs.shape == (2,)
    # the last prompt token alone: nothing scored
    assert P.decode_generate(_answer([[None, 9, None]]), None, scored=SCORED[2:]).input_logprobs.shape == (0,)
    # SGLang 0.5.23 answers a request of no new token with the next token's most likely: not an output token's
    answer = _answer(GOOD)
    answer["meta_info"]["output_top_logprobs"] = [GOOD_TOP[1]]
    assert P.decode_generate(answer, None, scored=SCORED).top_ids is None
    # aborted before its prefill: none
    assert P.decode_generate(_answer([], finish="abort"), None, scored=SCORED).input_logprobs is None


@pytest.mark.parametrize(
    ("entries", "top", "message"),
    [
        ([GOOD[0], [None, 8, None], GOOD[2]], None, "not a number"),
        ([[-0.1, 7, None], *GOOD[1:]], None, "first input_token_logprobs entry that is not null"),
        ([GOOD[0], [-1.5, 5, None], GOOD[2]], None, "not the prompt's"),
        (GOOD[:2], None, "not the prompt's"),
        ([], None, "without the input log-probs asked for"),
        (GOOD, GOOD_TOP[:2], "input_top_logprobs"),
        (GOOD, [GOOD_TOP[1], *GOOD_TOP[1:]], "input_top_logprobs"),
        (GOOD, [None, None, GOOD_TOP[2]], "input_top_logprobs"),
    ],
    ids=[
        "a null after the first",
        "a first that is not null",
        "another id",
        "too few",
        "none",
        "too few top",
        "top first not null",
        "a top null after the first",
    ],
)
def test_an_answer_sglang_would_not_give_is_broken(entries, top, message):
    with pytest.raises(P.BrokenAnswer, match=message):
        P.decode_generate(_answer(entries, top), None, scored=SCORED)
