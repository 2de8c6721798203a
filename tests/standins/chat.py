"""A stand-in tokenizer for chat-level tests (no transformers): one token per character,
and a chat template that wraps each message in role markup and lists the tool names, so
multi-turn code (rendering, continuations, tool calls) runs on exact, readable tokens."""

from __future__ import annotations

from typing import Any

from rollout_servers.samples import Sample

#: The end-of-turn character (and token): what a sampled turn ends with.
EOT = "\x03"


class CharTokenizer:
    """Token id = the character's code point; decoding is exact."""

    eos_token_id = ord(EOT)
    vocab_size = 0x110000  # every code point

    def apply_chat_template(
        self,
        conversation: Any,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> Any:
        names = ",".join(t["function"]["name"] for t in tools or [])
        text = "".join(f"<{m['role']}>{m['content']}{EOT}" for m in conversation)
        return f"[{names}]" + text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> Any:
        return "".join(map(chr, token_ids))


#: What :class:`ReplyEngine` answers: a short reply and the end of the turn.
REPLY = "ok" + EOT


class ReplyEngine:
    """A generation engine that answers :data:`REPLY` (character tokens, logprob -0.1);
    raises once when :attr:`fail_next` is set."""

    version = 0
    partial = False  # never loads weights

    def __init__(self) -> None:
        self.fail_next = False
        self.calls = 0

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Sample:
        self.calls += 1
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the engine hiccuped")
        ids = [ord(c) for c in REPLY]
        return Sample(ids, [-0.1] * len(ids), [(0, len(ids))], "stop")

    async def reach(self, version: int, timeout_s: float) -> float:
        return 0.0  # never loads weights: every version counts as loaded
