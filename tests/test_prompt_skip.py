"""Skipping prompts the group filter keeps dropping (``algorithm.filter_groups.
skip_uninformative``, :mod:`asyncrl.control.prompt_skip`): the rule with hand-computed
chances, the coordinator dealing under it (fewer groups thrown away, the accounting identity
intact, a prompt that starts to carry a signal again comes back), its state across a
restore, and the config that switches it."""

from __future__ import annotations

from collections import Counter

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.control.group_filter import GroupFilter
from asyncrl.control.prompt_skip import PromptSkip
from asyncrl.control.setup import state_from_config
from asyncrl.control.task_source import TaskSource
from tests.test_accounting import B, Run, _group
from tests.test_filter_groups import _dealt_twice
from tests.test_pacing import _rows

ROWS = 8


def test_the_chance_to_deal_a_row_halves_per_filtered_group_down_to_the_floor():
    skip = PromptSkip(explore=0.5, explore_min=0.1, seed=1)
    chances = []
    for _ in range(5):
        skip.record(3, informative=False)
        chances.append(skip.keep_probability(3))
    assert chances == [0.5, 0.25, 0.125, 0.1, 0.1]
    assert skip.keep_probability(4) == 1.0 and not skip.skip(4, 0, 0)  # never filtered
    skip.record(3, informative=True)  # trained once: dealt every time again
    assert skip.keep_probability(3) == 1.0 and skip.streak == {}
    with pytest.raises(ValueError, match="must be in"):
        PromptSkip(explore=0.0, explore_min=0.1, seed=1)


def test_the_draw_is_a_function_of_the_position_and_the_streak():
    a, b = (PromptSkip(explore=0.5, explore_min=0.1, seed=7) for _ in range(2))
    for s in (a, b):
        s.record(0, informative=False)
    draws = [a.skip(0, e, p) for e in range(4) for p in range(50)]
    assert draws == [b.skip(0, e, p) for e in range(4) for p in range(50)]
    assert 60 < sum(draws) < 140  # about half of 200 passed over at streak 1
    assert a.skipped == sum(draws)


def test_row_of_names_the_training_row_of_an_id():
    source = TaskSource(_rows(5), _rows(2, "test"), seed=3, lineage="ab")
    first = [source.next_train() for _ in range(7)]  # into the second epoch
    for t in first:
        assert source.row_of(t.task_id) == t.extra_info["index"]
    retry, _ = source.retry_of(first[1].task_id, 0)
    assert source.row_of(retry.task_id) == first[1].extra_info["index"]
    source.start_validation()
    val = source.next_val()
    assert val is not None and source.row_of(val.task_id) is None
    assert source.row_of("train.zz/0/1") is None and source.row_of("ext/s/1") is None


def _run(skip: bool, bound: int = 0) -> Run:
    """The accounting tests' stepped run over ``ROWS`` rows, filter on (and skipping)."""
    run = Run(0, rows=ROWS)
    gf = GroupFilter(
        enable=True,
        max_num_gen_batches=bound,
        batch_size=B,
        skip=PromptSkip(explore=0.5, explore_min=0.1, seed=1) if skip else None,
    )
    run.st.group_filter = gf
    gf.attach(run.st.ledger.source)  # what ControlState does with a filter it is built with
    return run


def _serve(run: Run, alike: set[int], steps: int) -> Counter[int]:
    """``steps`` learner steps; the server filters the groups of rows in ``alike``.
    Returns the deals per row."""
    deals: Counter[int] = Counter()
    for _ in range(steps):
        while grant := run.st.grant("s", 64, 0.0).tasks:
            for t in grant:
                row = int(t.extra_info["index"])
                deals[row] += 1
                if t.filter and row in alike:
                    assert run.st.ack("s", [t.task_id], 0.0, filtered=True).acked
                else:
                    run.buf.add_packed(_group(t, run.st.version), 0.0)
                    run.st.ack("s", [t.task_id], 0.0)
        assert run.step()
    return deals


def test_rows_the_filter_keeps_dropping_are_dealt_less_and_come_back():
    alike = {0, 1, 2, 3}  # half the rows score alike every time
    plain, skipping = _run(skip=False), _run(skip=True)
    without, with_skip = _serve(plain, alike, 40), _serve(skipping, alike, 40)
    thrown = lambda deals: sum(deals[r] for r in alike)  # noqa: E731
    kept = lambda deals: sum(deals[r] for r in range(ROWS) if r not in alike)  # noqa: E731
    assert kept(without) == kept(with_skip) == 40 * B  # the same batches trained
    assert thrown(without) == 40 * B  # every epoch deals each row once
    # streaks of k keep a row with chance 0.5**k, at least 0.1: about 0.1 * 160 + 6
    assert 4 <= thrown(with_skip) < 0.3 * thrown(without)
    assert all(with_skip[r] >= 2 for r in alike)  # still tried now and then
    a = skipping.acct()  # the identity holds: a skipped row was never a task
    assert a["accounting/train/dropped/filtered"] == thrown(with_skip)
    m = skipping.st.metrics()
    assert m["filter/prompts_skipped"] == skipping.st.group_filter.skip.skipped > 0  # type: ignore[union-attr]
    # The model un-learns them: their groups carry a signal again, and once a row's next
    # (explored) group trains, it is dealt every epoch again.
    _serve(skipping, set(), 60)
    after = _serve(skipping, set(), 10)
    assert all(after[r] == after[ROWS - 1] for r in alike), after
    assert skipping.st.group_filter.skip.streak == {}  # type: ignore[union-attr]


def test_past_the_filters_bound_nothing_is_skipped():
    gf = GroupFilter(
        enable=True,
        max_num_gen_batches=1,
        batch_size=2,
        skip=PromptSkip(explore=0.5, explore_min=0.1, seed=1),
    )
    for _ in range(10):
        gf.skip.record(5, informative=False)  # type: ignore[union-attr]
    assert any(gf.skip_row(5, 0, p) for p in range(20))
    gf.filtered(2, step=0)  # the bound: dealt unfiltered, so every group trains
    assert not gf.active and not any(gf.skip_row(5, 0, p) for p in range(20))


def test_groups_dealt_unfiltered_past_the_bound_leave_the_streaks():
    """Past max_num_gen_batches the groups are dealt unfiltered and pushed whatever they
    score: their acks say nothing about the prompt, and must not clear its streak."""
    run = _run(skip=True, bound=1)
    deals = _serve(run, set(range(ROWS)), 1)  # every group alike: B filtered, then the bound
    skip = run.st.group_filter.skip
    assert skip is not None and run.st.metrics()["filter/bound_hits"] == 1
    assert sum(deals.values()) == 2 * B  # B filtered, then B dealt unfiltered and trained
    assert len(skip.streak) == B and set(skip.streak.values()) == {1}, skip.streak
    _serve(run, set(range(ROWS)), 3)
    assert sum(skip.streak.values()) == run.st.metrics()["filter/groups_filtered"]


def test_a_task_dealt_again_unfiltered_is_no_verdict():
    """A task dealt with the filter on, then again without it (its server died, and the
    bound was reached meanwhile): its ack is no verdict on its prompt."""
    from asyncrl.control import messages as m

    gf = GroupFilter(
        enable=True,
        max_num_gen_batches=0,
        batch_size=2,
        skip=PromptSkip(explore=0.5, explore_min=0.1, seed=1),
    )
    gf.row_of = lambda tid: 3
    gf.skip.record(3, informative=False)  # type: ignore[union-attr]
    task = m.Task(
        task_id="train/0/3", data_source="a", prompt=[], ground_truth="1", n=2, filter=True
    )
    gf.dealt([task])
    gf.dealt([m.Task(**{f: getattr(task, f) for f in task.__struct_fields__} | {"filter": False})])
    gf.verdicts([task.task_id], filtered=False)
    assert gf.skip.streak == {3: 1}  # type: ignore[union-attr]
    gf.dealt([task])  # dealt filtered once more: now its ack counts
    gf.verdicts([task.task_id], filtered=False)
    assert gf.skip.streak == {}  # type: ignore[union-attr]


def test_a_restored_coordinator_skips_the_same_rows():
    alike = {1, 4, 6}
    first = _run(skip=True)
    _serve(first, alike, 12)
    saved = first.st.state_dict()
    second = _run(skip=True)
    second.st.load_state_dict(saved)
    assert second.st.group_filter.skip.streak == first.st.group_filter.skip.streak  # type: ignore[union-attr]
    ids = []
    for run in (first, second):
        tasks = [run.st.ledger.source.next_train() for _ in range(30)]
        ids.append([t.task_id for t in tasks if t is not None])
    assert ids[0] == ids[1] and len(ids[0]) == 30


def test_a_task_taken_back_after_a_restart_still_gives_its_row_a_verdict():
    """A task dealt with the filter on is out when the learner restarts; its server takes
    it back and pushes an informative group: the row's streak ends, as without the
    restart (before, the restored filter no longer knew the task was being judged)."""
    import json

    from asyncrl.control import messages as m

    first = _run(skip=True)
    task = first.st.grant("s", 1, 0.0).tasks[0]
    row = first.st.ledger.source.row_of(task.task_id)
    assert task.filter and row is not None
    first.st.group_filter.skip.streak[row] = 3  # type: ignore[union-attr]
    saved = json.loads(json.dumps(first.st.state_dict()))  # as the checkpoint keeps it
    second = _run(skip=True)
    second.st.load_state_dict(saved)
    second.st.register(m.Register(server_id="s", engine_world_size=0, task_ids=[task.task_id]), 1.0)
    assert second.st.ack("s", [task.task_id], 2.0).acked == [task.task_id]
    assert row not in second.st.group_filter.skip.streak  # type: ignore[union-attr]


def test_a_group_trained_before_its_servers_ack_ends_its_rows_streak():
    """Found by a review: the learner trained a judged group before its server's ack came
    (the ack then unknown). The group was pushed, so it carried a signal; its row kept its
    streak and went on being passed over."""
    run = _run(skip=True)
    task = run.st.grant("s", 1, 0.0).tasks[0]
    row = run.st.ledger.source.row_of(task.task_id)
    assert task.filter and row is not None
    run.st.group_filter.skip.streak[row] = 3  # type: ignore[union-attr]
    run.buf.add_packed(_group(task, run.st.version), 0.0)  # pushed; its ack not yet in
    run.st.trained([task.task_id])
    assert row not in run.st.group_filter.skip.streak  # type: ignore[union-attr]
    assert run.st.ack("s", [task.task_id], 1.0).unknown == [task.task_id]
    assert row not in run.st.group_filter.skip.streak  # type: ignore[union-attr]


def test_the_config_switches_it_on_with_the_filter_only():
    on = [
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.skip_uninformative=true",
        "algorithm.filter_groups.skip_explore=0.25",
    ]
    st = state_from_config(load_config("configs/cpu_demo.yaml", on), _rows(8), _rows(2, "test"))
    skip = st.group_filter.skip
    assert skip is not None and skip.explore == 0.25 and skip.explore_min == 0.1
    assert st.ledger.source.skip == st.group_filter.skip_row
    plain = load_config("configs/cpu_demo.yaml", on[:1])
    assert state_from_config(plain, _rows(8), _rows(2, "test")).ledger.source.skip is None
    with pytest.raises(ConfigError, match="filter_groups.enable=true"):
        load_config("configs/cpu_demo.yaml", on[1:2])


def test_tasks_that_never_get_a_verdict_are_forgotten_at_the_next_step():
    """Found by a review: a task dealt with the filter on that never gets a verdict (its
    prompt too long to generate, a copy trained or dropped for lag whose ack never came)
    stayed among those awaiting one for the whole run, in memory and in every checkpoint."""
    run = _run(skip=True)
    task = run.st.grant("s", 1, 0.0).tasks[0]
    assert task.filter and task.task_id in run.st.state_dict()["group_filter"]["judging"]
    run.st.ack("s", [task.task_id], 0.0, filtered=True, prompt_too_long=True)  # no verdict
    assert run.st.ledger.entries[task.task_id].state == "dropped/prompt_too_long"
    run.st.on_step(1)
    assert task.task_id not in run.st.state_dict()["group_filter"].get("judging", [])


def test_a_failure_report_of_an_earlier_deal_leaves_the_next_deal_awaiting_its_verdict():
    """Found by a review: the filter forgot the tasks of a failure report before the
    ledger judged it, so a report of an earlier deal (ignored there) took the task's live
    deal out of those awaiting a verdict: its group then never moved its prompt's skip
    streak. Only the tasks the report did fail are forgotten."""
    run = _run(skip=True)
    task, _ = _dealt_twice(run)
    run.st.nack("s", [task.task_id], "boom", 0.0, [task.attempt])  # the resend
    assert run.st.ledger.counts["nacks_of_earlier_deals"] == 1
    assert run.st.group_filter.forget([task.task_id]) == [task.task_id]  # still judged
