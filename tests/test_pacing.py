"""Per-server pacing (``staleness.pace_servers``, :mod:`asyncrl.control.pacing`): its rule
with hand-computed steps, and the ledger dealing under it: a server whose groups are dropped
for lag is dealt fewer, validation still reaches it, a restart starts it afresh, and the
accounting identity holds throughout."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import load_config
from asyncrl.control.admission import Budget
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.pacing import WINDOW, Pacer
from asyncrl.control.setup import state_from_config
from asyncrl.control.task_source import TaskSource
from asyncrl.tasks import make_row
from asyncrl.wire import DroppedTask


def _rows(n: int, split: str = "train") -> list[dict]:
    return [make_row("arithmetic", f"{i}+1=", str(i + 1), split=split, index=i) for i in range(n)]


def _ledger(ceiling: int = 4, n_val: int = 0) -> TaskLedger:
    source = TaskSource(_rows(200), _rows(n_val, "test"), seed=3, n=2, val_n=1, lineage="")
    return TaskLedger(source, Budget(1, 100), lag_retries=5, pacer=Pacer(ceiling))


def test_the_rule_steps_down_per_stale_group_and_up_per_cap_trained():
    p = Pacer(ceiling=4)
    assert (p.cap("s"), p.room("s", 1), p.room("s", 9)) == (4, 3, 0)
    p.fresh("f")  # another server delivers on time: s's stale groups stand out
    for _ in range(2):
        p.stale("s")
    assert p.cap("s") == 2
    for _ in range(5):  # never below one group
        p.stale("s")
    assert p.cap("s") == 1
    p.fresh("s")  # one trained at cap 1: up to 2
    assert p.cap("s") == 2
    p.fresh("s")
    p.stale("s")  # a stale group resets the credit as well
    assert p.cap("s") == 1
    for _ in range(1 + 2 + 3):  # 1 at cap 1, 2 at cap 2, 3 at cap 3
        p.fresh("s")
    assert p.cap("s") == 4
    p.fresh("s")  # the ceiling holds
    assert p.cap("s") == 4 and p.cap("other") == 4
    p.stale("s")
    p.forget("s")
    assert p.cap("s") == 4
    assert p.metrics() == {"pace/narrowed": 5.0, "pace/widened": 4.0, "pace/cap_min": 4.0}
    with pytest.raises(ValueError, match="one group"):
        Pacer(0)


def test_stale_groups_on_every_server_alike_or_on_a_lone_server_pace_no_one():
    """Drops that holding fewer cannot fix (long answers overtaken everywhere, a lag limit
    too tight): narrowing would only cost throughput."""
    lone = Pacer(ceiling=4)
    for _ in range(10):
        lone.stale("s")
    assert lone.cap("s") == 4
    alike = Pacer(ceiling=4)
    for _ in range(10):  # both servers: 1 stale in 4
        for server in ("a", "b"):
            alike.fresh(server)
            alike.fresh(server)
            alike.fresh(server)
            alike.stale(server)
    assert (alike.cap("a"), alike.cap("b")) == (4, 4)
    rare = Pacer(ceiling=4)  # under MIN_STALE_SHARE: routine, not a slow server
    for _ in range(40):
        rare.fresh("a")
        rare.fresh("b")
    rare.stale("a")
    assert rare.cap("a") == 4
    # Tallies cover recent groups: a long clean history does not hide a slow spell.
    for _ in range(30):
        rare.stale("a")
    assert rare.cap("a") < 4 and rare.recent["a"][0] + rare.recent["a"][1] <= WINDOW


def test_a_server_whose_groups_go_stale_is_dealt_fewer_and_the_fast_one_is_not():
    ledger = _ledger(ceiling=4)
    slow, _ = ledger.deal("slow", 10)
    fast, _ = ledger.deal("fast", 10)
    assert (len(slow), len(fast)) == (4, 4)  # the ceiling: rollout.max_inflight // n
    # The fast server delivers and its groups train; the slow one's arrive too late.
    ledger.ack([t.task_id for t in fast])
    ledger.trained([t.task_id for t in fast])
    stale = [t.task_id for t in slow[:3]]
    ledger.ack(stale)
    ledger.dropped([DroppedTask(t, "lag", False) for t in stale])
    assert ledger.pacer is not None and ledger.pacer.cap("slow") == 1
    more, reason = ledger.deal("slow", 10)
    assert (more, reason) == ([], "pace")  # it still holds one, its cap
    again, _ = ledger.deal("fast", 10)
    assert len(again) == 4  # the fast server is not paced
    # Its last group trains: cap 2, and it holds none, so two more.
    ledger.ack([slow[3].task_id])
    ledger.trained([slow[3].task_id])
    more, reason = ledger.deal("slow", 10)
    assert (len(more), reason) == (2, "pace")
    acc = ledger.accounting()
    assert acc["accounting/train/unaccounted"] == 0
    assert acc["accounting/train/dropped/lag"] == 3
    assert ledger.metrics()["coordinator/pace/cap_min"] == 2
    # A learner restart: the slow server outlives it, and so does what pacing learned of it
    # (a review found it back at the ceiling, paying again the lag drops pacing had saved).
    from asyncrl.control.ledger_checkpoint import load_ledger, save_ledger

    restored = _ledger(ceiling=4)
    load_ledger(restored, json.loads(json.dumps(save_ledger(ledger))))
    assert restored.pacer is not None
    assert (restored.pacer.cap("slow"), restored.pacer.cap("fast")) == (2, 4)
    assert restored.pacer.state_dict() == ledger.pacer.state_dict()


def test_a_late_group_is_charged_to_the_server_that_delivered_it():
    """Found by a review: an ack did not say who delivered the group, so the pacer blamed
    the task's last holder. A slow server's task timed out and was dealt to a fast one;
    the slow one's late group, dropped for lag, narrowed the fast server."""
    source = TaskSource(_rows(200), seed=3, n=2, lineage="")
    ledger = TaskLedger(source, Budget(1, 100), pacer=Pacer(4), task_timeout_s=10.0)
    (task,), _ = ledger.deal("slow", 1)
    assert ledger.reclaim(now=60.0) == [task.task_id]  # timed out: dealt again
    (again,), _ = ledger.deal("fast", 1)
    assert again.task_id == task.task_id
    ledger.ack([task.task_id], now=61.0, server_id="slow")  # the slow copy arrives first
    ledger.dropped([DroppedTask(task.task_id, "lag", False)])
    assert ledger.pacer is not None
    recent = ledger.pacer.state_dict()["recent"]  # per server: stale and fresh tallies
    assert "fast" not in recent and recent["slow"][0] == 1.0, recent


def test_a_paced_server_still_gets_validation_and_a_restart_starts_it_afresh():
    ledger = _ledger(ceiling=3, n_val=2)
    fast, _ = ledger.deal("fast", 3)
    ledger.ack([t.task_id for t in fast])
    ledger.trained([t.task_id for t in fast])
    first, _ = ledger.deal("slow", 3)
    ids = [t.task_id for t in first]
    ledger.ack(ids)
    ledger.dropped([DroppedTask(t, "lag", False) for t in ids])  # cap 3 -> 1 (the floor)
    held, _ = ledger.deal("slow", 1)  # one lag retry, its cap
    assert len(held) == 1 and not held[0].validation
    ledger.source.start_validation()
    val, reason = ledger.deal("slow", 5)
    assert [t.validation for t in val] == [True, True] and reason == "pace"
    ledger.release("slow", "dead")  # a restart: its tasks go back, its cap to the ceiling
    back, _ = ledger.deal("slow", 9)
    assert back[0].task_id == held[0].task_id  # the oldest deal first
    assert sum(not t.validation for t in back) == 3 and sum(t.validation for t in back) == 2
    assert ledger.accounting()["accounting/train/unaccounted"] == 0


@pytest.mark.parametrize("pace", [True, False])
def test_the_config_switches_pacing_and_sets_the_ceiling(pace: bool):
    cfg = load_config(
        "configs/cpu_demo.yaml",
        [f"staleness.pace_servers={str(pace).lower()}", "rollout.max_inflight=40"],
    )
    ledger = state_from_config(cfg, _rows(8), _rows(2, "test")).ledger
    if pace:
        assert ledger.pacer is not None and ledger.pacer.ceiling == 40 // cfg.rollout.n
    else:
        assert ledger.pacer is None
