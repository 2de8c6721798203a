"""How a row's prompt becomes tokens: the model's chat template, as veRL applies it, except
for a prompt that already holds the template's markup (TinyZero's countdown files write
the whole chat into one message) and for a tokenizer with no template (a base model)."""

from __future__ import annotations

import copy

import pytest

from asyncrl.prepare.tokenizer import build_tokenizer, chat_prompt_ids

# What TinyZero's countdown preprocessing (its qwen-instruct template) writes as the
# content of the row's one user message.
TINYZERO_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant. You first think about the reasoning "
    "process in the mind and then provide the user with the answer.<|im_end|>\n"
    "<|im_start|>user\n Using the numbers [3, 5, 7], create an equation that equals 22. "
    "Show your work in <think> </think> tags.<|im_end|>\n"
    "<|im_start|>assistant\nLet me solve this step by step.\n<think>"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


def test_a_prompt_that_holds_the_chat_markup_is_used_as_it_is(tok):
    ids = chat_prompt_ids(tok, [{"role": "user", "content": TINYZERO_PROMPT}])
    assert _text(tok, ids) == TINYZERO_PROMPT  # ends in the opened <think>, as it should
    assert ids == tok.encode(TINYZERO_PROMPT, add_special_tokens=False)


def test_a_plain_prompt_gets_the_template_with_the_generation_prompt(tok):
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    text = _text(tok, chat_prompt_ids(tok, messages))
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    # The markup only counts as a whole: a prompt that merely mentions "assistant" or
    # holds one marker is templated as any other.
    for content in ("The assistant says hi", "<|im_start|>assistant"):
        text = _text(tok, chat_prompt_ids(tok, [{"role": "user", "content": content}]))
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


def test_several_messages_are_always_templated(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": TINYZERO_PROMPT},
    ]
    text = _text(tok, chat_prompt_ids(tok, messages))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_a_tokenizer_without_a_template_reads_the_messages_text(tok):
    base = copy.deepcopy(tok)
    base.chat_template = None  # transformers would raise: a base model's prompts as text
    one = [{"role": "user", "content": "A conversation. Assistant: <think>"}]
    assert _text(base, chat_prompt_ids(base, one)) == "A conversation. Assistant: <think>"
    two = [{"role": "system", "content": "Be brief."}, *one]
    assert _text(base, chat_prompt_ids(base, two)) == "Be brief.\n" + one[0]["content"]
