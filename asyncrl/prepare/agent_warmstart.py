"""The agent demo's warm start: supervised training on whole tool-using episodes of the
calculator task, and their success rate when sampled.

Episodes are laid out in tokens exactly as the rollout server will lay them out
(:mod:`asyncrl.tools.tokens`): the prompt, each assistant turn followed by the end-of-turn
token, and between turns the chat template's tokens for the tool's answer. The loss is on
the assistant turns only. Tool calls are answered in this process (the calculator's
result), since there is nothing to sandbox in a warm start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncrl.tasks import calculator
from asyncrl.tools.hermes import parse_tool_calls
from asyncrl.tools.tokens import continuation, render

Problem = calculator.Problem


def episode_tokens(tok: Any, messages: list[dict], tools: list[dict] | None) -> tuple[list, list]:
    """``(ids, labels)`` of a whole conversation: labels are the ids on assistant turns
    (and their end-of-turn token), -100 elsewhere."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = render(tok, messages[:first], tools, gen=True)
    labels = [-100] * len(ids)
    for i in range(first, len(messages)):
        m = messages[i]
        if m["role"] == "assistant":
            turn = tok.encode(m["content"], add_special_tokens=False) + [tok.eos_token_id]
            ids, labels = ids + turn, labels + turn
            continue
        if i > 0 and messages[i - 1]["role"] != "assistant":
            continue  # a run of non-assistant messages is added once, at its first
        end = next((j for j in range(i, len(messages)) if messages[j]["role"] == "assistant"), None)
        if end is None:
            break
        before = render(tok, messages[:i], tools, gen=False)
        after = render(tok, messages[:end], tools, gen=True)
        tail = continuation(ids, before, after)
        if tail is None:
            raise ValueError("the chat template rewrites the history: cannot lay out episodes")
        ids, labels = ids + tail, labels + [-100] * len(tail)
    return ids, labels


def episode_batch(tok: Any, problems: Sequence[Problem]) -> tuple[Any, Any]:
    """Right-padded ``input_ids [B, T]`` and ``labels [B, T]`` of the ideal episodes."""
    import torch

    rows = [episode_tokens(tok, calculator.conversation(p), tool_schemas()) for p in problems]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, lab) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(lab)] = torch.tensor(lab)
    return ids, labels


def tool_schemas() -> list[dict]:
    """The calculator tools as a chat template names them (their schema's function)."""
    return [{"type": "function", "function": {"name": n}} for n in ("add", "mul")]


def answer_call(text: str) -> str:
    """What the calculator answers to the first call in ``text`` (an error text if none)."""
    calls = parse_tool_calls(text).calls
    if not calls:
        return "Error: no tool call"
    c = calls[0]
    try:
        a, b = int(c.arguments["a"]), int(c.arguments["b"])
    except (KeyError, TypeError, ValueError):
        return "Error: arguments a and b must be integers"
    return {"add": str(a + b), "mul": str(a * b)}.get(c.name, f"Error: unknown tool {c.name}")


def episode_accuracy(
    model: Any,
    tok: Any,
    problems: Sequence[Problem],
    *,
    samples_per_prompt: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """Mean score of two-turn episodes sampled at ``temperature`` (0: greedy): a call, its
    answer, then the final answer."""
    import torch

    from asyncrl.prepare.warmstart import generate_ids

    torch.manual_seed(seed)
    k = 1 if temperature == 0 else samples_per_prompt
    rows = [p for p in problems for _ in range(k)]
    tools = tool_schemas()
    histories = [[{"role": "user", "content": f"{a}{op}{b}="}] for a, op, b in rows]
    held = [render(tok, h, tools, gen=True) for h in histories]
    turn1 = generate_ids(model, tok, held, temperature=temperature, max_new_tokens=72)
    second: list[list[int]] = []
    for h, ids, out in zip(histories, held, turn1, strict=True):
        text = tok.decode(_cut(out, tok.eos_token_id), skip_special_tokens=False)
        h.append({"role": "assistant", "content": text})
        ids = ids + _cut(out, tok.eos_token_id) + [tok.eos_token_id]
        before = render(tok, h, tools, gen=False)
        h.append({"role": "tool", "content": answer_call(text)})
        tail = continuation(ids, before, render(tok, h, tools, gen=True)) or []
        second.append(ids + tail)
    turn2 = generate_ids(model, tok, second, temperature=temperature, max_new_tokens=8)
    scores = []
    for p, start, ids, out in zip(rows, held, second, turn2, strict=True):
        response = tok.decode(ids[len(start) :] + out, skip_special_tokens=True)
        scores.append(calculator.compute_score(response, calculator.answer(p)))
    return sum(scores) / len(scores)


def _cut(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids
