"""Locally built models load in vLLM (CPU) and transformers and agree on logprobs.

vLLM reports the sampled token's logprob after temperature (``processed_logprobs``); a
transformers forward pass over the same tokens, logits divided by the same temperature, must
give the same numbers: that is what the learner's importance weights rest on.
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.prepare.tokenizer import chat_prompt_ids as prompt_ids
from asyncrl.prepare.warmstart import generate
from asyncrl.tasks import arithmetic
from tests.conftest import prepare_report

TEMPERATURE = 0.7


def _engine(path):
    from vllm import LLM

    return LLM(
        model=str(path),
        dtype="float32",
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        max_model_len=256,
        seed=0,
    )


def _hf_logprobs(model, prompt: list[int], response: list[int], temperature: float):
    """Logprob of each response token under ``model`` at ``temperature``: shape [len(response)]."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.fixture(scope="module", params=["tiny", "small"])
def built(request, tiny_model, small_model):
    path = tiny_model if request.param == "tiny" else small_model
    llm = _engine(path)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    yield request.param, path, llm, hf, tok
    del llm
    gc.collect()


@pytest.mark.slow  # starts a vLLM engine
def test_sampled_logprobs_match_transformers(built):
    from vllm import SamplingParams

    name, _, llm, hf, tok = built
    _, val = arithmetic.generate(seed=0)
    prompts = [prompt_ids(tok, row["prompt"]) for row in val[:8]]
    params = SamplingParams(
        temperature=TEMPERATURE, top_p=1.0, top_k=-1, max_tokens=12, logprobs=0, n=4, seed=3
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    worst, checked = 0.0, 0
    for prompt, out in zip(prompts, outs, strict=True):
        for sample in out.outputs:
            response = list(sample.token_ids)
            assert response, "empty response"
            vllm_lp = torch.tensor(
                [d[t].logprob for d, t in zip(sample.logprobs, response, strict=True)]
            )
            hf_lp = _hf_logprobs(hf, prompt, response, TEMPERATURE)
            worst = max(worst, (vllm_lp - hf_lp).abs().max().item())
            checked += len(response)
    assert checked > 50
    assert worst < 1e-4, f"{name}: vLLM vs transformers logprob gap {worst:.2e}"


@pytest.mark.slow  # starts a vLLM engine
def test_greedy_answers_agree(built):
    from vllm import SamplingParams

    name, _, llm, hf, tok = built
    if name != "tiny":
        pytest.skip("greedy agreement is checked on the warm-started model")
    _, val = arithmetic.generate(seed=0)
    messages = [row["prompt"] for row in val]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate(
        [{"prompt_token_ids": prompt_ids(tok, m)} for m in messages], params, use_tqdm=False
    )
    vllm_text = [o.outputs[0].text for o in outs]
    hf_text = generate(hf, tok, messages, temperature=0.0, max_new_tokens=8)
    assert vllm_text == hf_text
    # The warm start gives partial skill: some answers right, not most.
    truths = [row["reward_model"]["ground_truth"] for row in val]
    right = sum(arithmetic.compute_score(t, g) for t, g in zip(vllm_text, truths, strict=True))
    assert 0 < right < len(val)


def test_warm_start_leaves_room_to_learn(tiny_model):
    report = prepare_report(tiny_model)["warm_start"]
    assert 0.1 <= report["val_sampling_accuracy"] <= 0.35
    assert report["steps"] > 0


def test_model_sizes(tiny_model, small_model):
    assert 0.25e6 <= prepare_report(tiny_model)["parameters"] <= 0.4e6
    assert 20e6 <= prepare_report(small_model)["parameters"] <= 30e6
