"""Fingerprints of prompt rows, saved with a checkpoint's data cursor: task ids name rows by
index, so a resume over other rows of the same count would rebuild the tasks in flight as
other prompts without a word. Each is a sha256 of the rows' JSON, the same in every process
and on every machine (never ``hash()`` of a str, which Python salts per process)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any


def rows_digest(rows: Sequence[dict[str, Any]]) -> str:
    """A short fingerprint of ``rows`` (their content, in order): a validation set swapped for
    another of the same size is told apart from the one a checkpoint's rounds were over."""
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def train_digest(rows: Sequence[dict[str, Any]], prompt_key: str = "prompt") -> str:
    """A short fingerprint of each row's data source, prompt and ground truth, in order:
    what a training task rebuilt from its id carries to the scorer. Cheaper than
    :func:`rows_digest` (no sorted keys, no extra columns), as a training set may hold
    millions of rows."""
    h = hashlib.sha256()
    for row in rows:
        reward = row.get("reward_model")
        truth = reward.get("ground_truth") if isinstance(reward, dict) else reward
        # A JSON list ends where its brackets close: row boundaries need no separator.
        fields = [row.get("data_source"), row.get(prompt_key), truth]
        h.update(json.dumps(fields, default=str).encode())
    return h.hexdigest()[:16]
