"""A character-level tokenizer in HF format, with a chat template.

One token per byte (byte-level BPE with no merges), so every string round-trips and ASCII
text is one token per character; plus Qwen's chat special tokens. Saved as a fast
tokenizer that both transformers and vLLM load from the model directory.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Qwen's chat markup, so a veRL user's chat-formatted prompts look the same here.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Tools (a chat template's ``tools`` argument) are named in one short system line: a
# tiny model learns the call format in its warm start, not from a schema in every prompt.
# Tool answers are messages of role ``tool``, like any other.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' }}"
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(out_dir: Path):  # -> transformers.PreTrainedTokenizerFast
    """Build the tokenizer, save it into ``out_dir`` and return it.

    Ids 0-255 are the bytes, 256-258 the special tokens; the end of a turn
    (``<|im_end|>``) is the end-of-sequence token, as in Qwen's instruct models.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tok.add_special_tokens({"additional_special_tokens": [IM_START]})
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    return tok


def chat_prompt_ids(tok: Any, messages: list[dict]) -> list[int]:
    """Token ids of the chat-formatted prompt, ending with the assistant header (veRL
    applies the model's chat template with ``add_generation_prompt=True`` the same way).

    Two kinds of prompt are used as their text instead (:func:`prompt_text`): one whose
    single message already holds the template's markup (TinyZero's countdown files write
    the whole chat into it; templated again, its ``<think>`` opening would sit inside a
    user turn), and any prompt for a tokenizer with no chat template (a base model)."""
    return tok.encode(prompt_text(tok, messages), add_special_tokens=False)


def prompt_text(tok: Any, messages: list[dict]) -> str:
    """The prompt as text: the chat template's rendering, or the messages' own text (see
    :func:`chat_prompt_ids`), said once per process."""
    if not getattr(tok, "chat_template", None):
        _note_once(
            "no_template",
            "the model's tokenizer has no chat template: prompts are "
            "their messages' text, one per line (as TinyZero used them)",
        )
        return "\n".join(str(m.get("content", "")) for m in messages)
    if len(messages) == 1 and (marker := _generation_marker(tok)):
        content = str(messages[0].get("content", ""))
        if marker in content:
            _note_once(
                "templated",
                f"prompts already hold the chat template's markup "
                f"({marker!r}): used as they are, not templated again",
            )
            return content
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


_SENTINEL = "\x00prompt\x00"
_markers: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # per tokenizer
_said: set[str] = set()


def _generation_marker(tok: Any) -> str:
    """What the template writes after a user's message to open the assistant's turn
    (Qwen's ``<|im_end|>\\n<|im_start|>assistant``), or "" when that is too short to tell
    a templated prompt by (then every prompt is templated)."""
    if tok not in _markers:
        one = [{"role": "user", "content": _SENTINEL}]
        text = tok.apply_chat_template(one, add_generation_prompt=True, tokenize=False)
        after = text.rsplit(_SENTINEL, 1)[-1].strip() if _SENTINEL in text else ""
        _markers[tok] = after if len(after) >= 8 else ""
    return _markers[tok]


def _note_once(kind: str, line: str) -> None:
    if kind not in _said:
        _said.add(kind)
        log.info("%s", line)
