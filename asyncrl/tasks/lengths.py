"""Prompt lengths as the rollout servers measure them, for ``data.filter_overlong_prompts``
on validation rows: veRL leaves an over-long prompt out of its validation set when it loads
it, and the coordinator does the same here (a round waits for every row it deals, so a
server cannot drop one, as it drops a training prompt). With the filter off and
``data.truncation=error``, such a row is refused when it is loaded (veRL's dataset fails on
it when it reads it), not failed at every round."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.config.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Episodes:
    """How a multi-turn server renders its episodes' first prompts: the rows it plays as
    episodes (``agent_name`` ``tool_agent``, the default with multi-turn on, so also rows
    without one) under the chat template with the tools' schemas (None: no tools)."""

    tools: list[dict[str, Any]] | None


def overlong_rows(
    rows: Sequence[dict[str, Any]],
    tokenizer_path: str,
    prompt_key: str,
    limit: int,
    episodes: Episodes | None = None,
) -> list[int]:
    """The indices of ``rows`` whose prompt, rendered as a rollout server renders it, is
    longer than ``limit`` tokens: a single-turn one under the chat template with the
    generation prompt (``chat_prompt_ids``), an episode's (``episodes``: multi-turn on)
    with the tools' schemas too, which add hundreds of tokens under some templates. Loads
    transformers and the tokenizer at ``tokenizer_path`` (``model.path``, the servers')."""
    from transformers import AutoTokenizer

    from asyncrl.prepare.tokenizer import chat_prompt_ids
    from asyncrl.tools.tokens import render

    tok = AutoTokenizer.from_pretrained(tokenizer_path)

    def length(row: dict[str, Any]) -> int:
        prompt: Any = row[prompt_key]
        episode = (row.get("agent_name") or "tool_agent") == "tool_agent"
        if episodes is not None and episode and not isinstance(prompt, str):
            return len(render(tok, list(prompt), episodes.tools, gen=True))
        return len(chat_prompt_ids(tok, row[prompt_key]))

    return [i for i, row in enumerate(rows) if length(row) > limit]


def fitting_val_rows(
    rows: Sequence[dict[str, Any]],
    tokenizer_path: str,
    prompt_key: str,
    limit: int,
    episodes: Episodes | None = None,
) -> list[dict[str, Any]]:
    """The validation rows with ``data.filter_overlong_prompts`` on: those whose prompt is
    over ``limit`` tokens are left out, as veRL leaves them out of its validation set when
    it loads it (said once, with the count); a set left empty is a
    :class:`~asyncrl.config.ConfigError`, since validation would never report."""
    long = set(overlong_rows(rows, tokenizer_path, prompt_key, limit, episodes))
    if not long:
        return list(rows)
    if len(long) == len(rows):
        raise ConfigError(
            [
                f"data.filter_overlong_prompts=true leaves out every one of the {len(rows)} "
                f"rows of data.val_files (each over data.max_prompt_length={limit} tokens), "
                "so validation would never report: raise data.max_prompt_length, or set "
                "trainer.val_before_train=false trainer.test_freq=-1"
            ]
        )
    log.info(
        "data.filter_overlong_prompts: %d of %d validation rows are over "
        "data.max_prompt_length=%d tokens and left out, as veRL leaves them out (first: "
        "row %d); validation scores the other %d",
        len(long),
        len(rows),
        limit,
        min(long),
        len(rows) - len(long),
    )
    return [row for i, row in enumerate(rows) if i not in long]


def refuse_overlong_val_rows(
    rows: Sequence[dict[str, Any]],
    tokenizer_path: str,
    prompt_key: str,
    limit: int,
    episodes: Episodes | None = None,
) -> None:
    """With ``data.truncation=error`` and the filter off: a validation row over ``limit``
    tokens is a :class:`~asyncrl.config.ConfigError` when it is loaded. Its task would fail
    at its server in every round, and be given up (``val/groups_given_up``), so that every
    round scored without it."""
    long = overlong_rows(rows, tokenizer_path, prompt_key, limit, episodes)
    if long:
        raise ConfigError(
            [
                f"data.truncation=error: {len(long)} of the {len(rows)} rows of "
                f"data.val_files (first: row {long[0]}) are over data.max_prompt_length="
                f"{limit} tokens, and would fail at every validation round: set "
                "data.filter_overlong_prompts=true to leave them out (as veRL does), "
                "data.truncation=left to cut them, or raise data.max_prompt_length"
            ]
        )
