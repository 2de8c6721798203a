"""Prompt lengths as the rollout servers measure them, for ``data.filter_overlong_prompts``
on validation rows: veRL leaves an over-long prompt out of its validation set when it loads
it, and the coordinator does the same here (a round waits for every row it deals, so a
server cannot drop one, as it drops a training prompt)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def overlong_rows(
    rows: Sequence[dict[str, Any]], tokenizer_path: str, prompt_key: str, limit: int
) -> list[int]:
    """The indices of ``rows`` whose prompt, rendered as a single-turn rollout server
    renders it (the chat template with the generation prompt, ``chat_prompt_ids``), is
    longer than ``limit`` tokens. Loads transformers and the tokenizer at
    ``tokenizer_path`` (``model.path``, the servers' own)."""
    from transformers import AutoTokenizer

    from asyncrl.prepare.tokenizer import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    return [i for i, row in enumerate(rows) if len(chat_prompt_ids(tok, row[prompt_key])) > limit]
