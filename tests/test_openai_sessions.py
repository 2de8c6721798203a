"""The OpenAI endpoint's pure parts: session keys, which messages a request adds, how a
sampled turn is shown to the agent, and the external slots the coordinator's ledger deals
(charged to the budget, never dealt again, accounted for through a restart)."""

from __future__ import annotations

import json

import pytest

from asyncrl.control.admission import Budget
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.ledger_checkpoint import load_ledger, save_ledger
from asyncrl.control.task_source import TaskSource
from asyncrl.tasks import make_row
from rollout_servers.agent import Episode
from rollout_servers.chat_bodies import assistant_reply
from rollout_servers.request_fields import max_tokens_of, reward_of
from rollout_servers.sessions import RequestError, Session, model_message, new_messages, split_key


def test_session_keys_name_group_and_member():
    assert split_key("g7/3", 4) == ("g7", "3")
    assert split_key("a/b/c", 2) == ("a/b", "c")  # the member is after the last slash
    assert split_key("solo", 1) == ("solo", "")
    with pytest.raises(RequestError, match="GROUP/MEMBER") as e:
        split_key("solo", 4)
    assert e.value.status == 400
    with pytest.raises(RequestError) as e:
        split_key("", 1)
    assert e.value.status == 401
    with pytest.raises(RequestError, match="must not be empty"):
        split_key("g/", 2)


def _session(shown: list[dict]) -> Session:
    return Session("g/0", 0, None, Episode(pieces=[], messages=[]), shown=shown)  # type: ignore[arg-type]


def test_new_messages_are_what_the_agent_added_after_the_shown_conversation():
    shown = [
        {"role": "user", "content": "47*29="},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]},
    ]
    sent = [
        {"role": "user", "content": [{"type": "text", "text": "47*29="}]},  # parts are text
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1363", "name": "mul"},
    ]
    assert new_messages(_session(shown), sent) == [
        {"role": "tool", "content": "1363", "name": "mul"}
    ]
    assert new_messages(_session(shown), sent[:2]) is None  # nothing new: a re-ask
    rewritten = [{"role": "user", "content": "48*29="}, *sent[1:]]
    assert new_messages(_session(shown), rewritten) is None  # history changed: new sample
    # An assistant message the model did not sample (a prefill, a handoff): a new sample.
    assert new_messages(_session(shown), [*sent[:2], {"role": "assistant", "content": "x"}]) is None
    with pytest.raises(RequestError, match="cannot be added"):
        new_messages(_session(shown), [*sent[:2], {"role": "critic", "content": "x"}])
    with pytest.raises(RequestError, match="text content"):
        new_messages(_session(shown), [*sent[:2], {"role": "user", "content": [{"type": "x"}]}])


def test_a_sampled_tool_call_is_shown_as_openai_tool_calls_and_read_back_inline():
    raw = (
        'Let me compute.<tool_call>\n{"name": "mul", "arguments": {"a": 47, "b": 29}}\n</tool_call>'
    )
    message, finish = assistant_reply(raw)
    assert finish == "tool_calls" and message["content"] == "Let me compute."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "mul"
    assert json.loads(call["function"]["arguments"]) == {"a": 47, "b": 29}
    back = model_message(message)  # a rewritten history renders the call as the model wrote it
    assert back["content"].startswith("Let me compute.<tool_call>\n")
    assert json.loads(back["content"].split("\n")[1]) == {
        "name": "mul",
        "arguments": {"a": 47, "b": 29},
    }
    assert assistant_reply("1363") == ({"role": "assistant", "content": "1363"}, "stop")


def test_token_budget_and_reward_are_checked():
    assert max_tokens_of({}, 50, 512) == 50
    assert max_tokens_of({"max_tokens": 10}, 50, 512) == 10
    assert max_tokens_of({"max_completion_tokens": 99}, 50, 512) == 50
    with pytest.raises(RequestError, match="POST /rl/reward") as spent:
        max_tokens_of({}, 0, 512)
    assert spent.value.body()["error"]["code"] == "context_length_exceeded"
    assert str(spent.value).startswith("This model's maximum context length is 512 tokens")
    with pytest.raises(RequestError, match="positive integer"):
        max_tokens_of({"max_tokens": -1}, 50, 512)
    assert reward_of({"reward": 1}) == 1.0
    bad_rewards = ({"reward": float("nan")}, {"reward": 1e39}, {"reward": True}, {"reward": "1"})
    for bad in (*bad_rewards, {}, []):  # 1e39: inf in the learner's float32
        with pytest.raises(RequestError, match="finite number"):
            reward_of(bad)


def _ledger() -> TaskLedger:
    rows = [make_row("arithmetic", f"{i}+1=", str(i + 1), split="train", index=i) for i in range(8)]
    # One training group per version (batch 1, sync every step), lag 0: one charged task.
    return TaskLedger(TaskSource(rows, seed=0, n=2), Budget(max_policy_lag=0, per_version=1))


def test_an_agent_refused_a_slot_is_served_before_the_datasets_next_task():
    """The servers' own task loops ask again the moment a slot frees: an agent refused a
    slot would wait behind them for ever. So a refused agent holds a claim on the next free
    slot for AGENT_HOLD_S; after that the dataset takes it again."""
    from asyncrl.control.ledger import AGENT_HOLD_S

    ledger = _ledger()
    (task,), _ = ledger.deal("s1", 1, now=0.0)  # the dataset holds the only slot
    assert ledger.deal_external("s2", now=1.0) == (None, "budget")
    ledger.nack("s1", [task.task_id])  # the slot frees (the task waits to be dealt again)
    assert ledger.deal("s1", 1, now=1.5) == ([], "budget")  # kept for the agent
    slot, _ = ledger.deal_external("s2", now=2.0)
    assert slot is not None and slot.task_id.startswith("ext/")
    ledger.nack("s2", [slot.task_id])  # the agent gives it back
    (again,), _ = ledger.deal("s1", 1, now=2.5)  # no agent waits: the dataset's again

    assert ledger.deal_external("s2", now=10.0) == (None, "budget")  # an agent that left
    ledger.nack("s1", [again.task_id])
    assert ledger.deal("s1", 1, now=10.0 + AGENT_HOLD_S / 2) == ([], "budget")
    assert len(ledger.deal("s1", 1, now=10.0 + AGENT_HOLD_S + 0.1)[0]) == 1  # claim lapsed


def test_external_slots_are_charged_and_given_up_rather_than_dealt_again():
    ledger = _ledger()
    task, reason = ledger.deal_external("s1", now=0.0)
    assert task is not None and reason == ""
    assert task.task_id == "ext/1" and task.prompt == [] and task.data_source == "external"
    assert ledger.deal_external("s1") == (None, "budget")  # the slot is the budget's
    assert ledger.deal("s2", 4) == ([], "budget")  # dataset tasks wait for it too
    held = ledger.budget_holders("s1")  # what a refused agent is told
    assert held.startswith("1 of the 1 groups admitted so far are charged"), held
    assert "1 generating (1 of them endpoint groups, 1 at this server)" in held, held
    assert ledger.release("s1", "dead") == []  # its server died: nothing to deal again
    acc = ledger.accounting()
    assert acc["accounting/train/given_up"] == 1 and acc["accounting/train/unaccounted"] == 0
    assert ledger.metrics()["coordinator/tasks/external_given_up/dead"] == 1

    task, _ = ledger.deal_external("s1")  # the refund opened the budget again
    assert task is not None and task.task_id == "ext/2"
    assert ledger.ack(["ext/2"]) == (["ext/2"], [])
    ledger.trained(["ext/2"])
    acc = ledger.accounting()
    assert acc["accounting/train/trained"] == 1
    # External slots are also tallied apart: dealt 2 = trained 1 + given up 1.
    assert acc["accounting/external/dealt"] == 2 and acc["accounting/external/trained"] == 1
    assert acc["accounting/external/given_up"] == 1
    assert acc["accounting/external/unaccounted"] == 0
    from asyncrl.launch.progress import accounting_lines

    (line,) = [x for x in accounting_lines([acc]) if x.startswith("accounting external")]
    assert line.startswith("accounting external: dealt 2") and "+ given back 1" in line


def test_a_long_agent_episode_keeps_its_slot_past_the_task_timeout():
    """A review: ``reclaim`` gave up an endpoint slot outstanding past
    ``control.task_timeout_s`` (an agent's 30-minute episode) while its group still lived
    at the server: the budget admitted another and the group's ack came back unknown. The
    server gives an idle group's slot back itself; a dataset task is still reclaimed."""
    ledger = _ledger()
    ledger.task_timeout_s = 1800.0
    slot, _ = ledger.deal_external("s1", now=0.0)
    assert slot is not None
    assert ledger.reclaim(now=1801.0) == [] and ledger.committed == 1
    assert ledger.deal_external("s1", now=1802.0) == (None, "budget")
    assert ledger.ack([slot.task_id], now=1900.0) == ([slot.task_id], [])
    dataset = _ledger()
    dataset.task_timeout_s = 1800.0
    (task,), _ = dataset.deal("s2", 1, now=0.0)  # a dataset task its live server lost
    assert dataset.reclaim(now=1801.0) == [task.task_id]


def test_external_slots_survive_a_coordinator_restart_without_reuse_or_re_deal():
    ledger = _ledger()
    ledger.budget.per_version = 3
    for _ in range(3):
        ledger.deal_external("s1")
    ledger.ack(["ext/1"])
    ledger.trained(["ext/1"])
    ledger.ack(["ext/2"])
    saved = save_ledger(ledger)

    restored = _ledger()
    restored.budget.per_version = 3
    load_ledger(restored, saved)
    states = {tid: e.state for tid, e in restored.entries.items()}
    # ext/3 was out: it waits for its server to name it (given up if none does by the end
    # of the resume hold), never dealt again
    assert states == {"ext/1": "done", "ext/2": "in_buffer", "ext/3": "queued"}
    assert not restored.redeal and restored.unclaimed == {"ext/3"}
    task, _ = restored.deal_external("s1")
    assert task is not None and task.task_id == "ext/4"  # ids are never reused
    assert restored.accounting()["accounting/train/unaccounted"] == 0
