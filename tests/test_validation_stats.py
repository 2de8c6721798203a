"""Validation rounds from the buffer's scored groups: score and its standard errors over
responses and over prompts, checked against the same figures computed from the raw
rewards; each group counted once, across rereads, buffer restarts and learner restarts."""

import json
import math
import statistics

from asyncrl.control.state import ValidationProgress
from asyncrl.wire import Trajectory, ValidationGroup
from learner.validation import ValidationTracker, mean_standard_error


def _groups(
    rows: list[list[float]], source: str = "s", round_key: str = "val.x/0", first: int = 0
) -> dict[str, ValidationGroup]:
    """Groups with these member rewards, by validation id (rows ``first``, ``first+1``...)."""
    return {
        f"{round_key}/{first + i}": ValidationGroup.of(source, list(r), len(r))
        for i, r in enumerate(rows)
    }


def _sem(xs: list[float]) -> float:
    return statistics.stdev(xs) / math.sqrt(len(xs))


def test_round_scores_and_standard_errors_match_the_raw_rewards():
    a = [[1, 1, 1, 0], [0, 0, 0, 0], [1, 0.5, 1, 1]]  # prompts of different difficulty
    b = [[0.25, 0.75, 1, 1], [0, 1, 0, 1]]
    progress = ValidationProgress(rounds_started=1, round_groups=5, head="val.x")
    tracker = ValidationTracker()
    assert tracker.pending(progress)
    assert tracker.add({"val.x/0": _groups(a[:2], "a")}, progress) == []  # 2 of 5 groups in
    # The buffer keeps what it scored: the next poll has the whole round.
    whole = {**_groups(a, "a"), **_groups(b, "b", first=3)}
    [out] = tracker.add({"val.x/0": whole}, progress)
    flat = [r for g in a + b for r in g]
    means = [sum(g) / len(g) for g in a + b]
    assert not tracker.pending(progress)
    assert math.isclose(out["val/score"], statistics.fmean(flat))
    assert math.isclose(out["val/score_se"], _sem(flat))
    assert math.isclose(out["val/score_se_prompt"], _sem(means))
    assert out["val/score_se_prompt"] > out["val/score_se"]  # prompts differ in difficulty
    assert math.isclose(out["val/a/score"], statistics.fmean([r for g in a for r in g]))
    assert out["val/responses"] == len(flat)


def test_binary_rewards_give_the_binomial_standard_error_up_to_n_over_n_minus_1():
    n, k = 40, 10
    se = mean_standard_error(n, k, k)  # 0/1 rewards: sum of squares == sum
    p = k / n
    assert math.isclose(se, math.sqrt(p * (1 - p) / n) * math.sqrt(n / (n - 1)))
    assert mean_standard_error(3, 3.0, 3.0) == 0.0  # all equal: no spread


def test_each_round_is_reported_once_and_a_restored_tracker_reads_the_rest_again():
    """Rounds are read from the buffer's groups by key: a round is reported once, rounds
    complete together are reported in order, and a tracker restored from a checkpoint taken
    before a round was read reports it (nothing is drained)."""
    progress = ValidationProgress(rounds_started=2, round_groups=1, head="val.x")
    tracker = ValidationTracker()
    saved = tracker.state_dict()  # a checkpoint before any round was read
    by_round = {
        "val.x/0": _groups([[1.0, 0.0]]),
        "val.x/1": _groups([[1.0, 1.0]], round_key="val.x/1"),
        "val.other/0": _groups([[1.0, 1.0]], round_key="val.other/0"),  # another lineage's
    }
    got = tracker.add(by_round, progress)
    assert [r["val/score"] for r in got] == [0.5, 1.0]
    assert tracker.add(by_round, progress) == [] and not tracker.pending(progress)
    restored = ValidationTracker()
    restored.load_state_dict(saved)
    assert restored.pending(progress)
    assert [r["val/score"] for r in restored.add(by_round, progress)] == [0.5, 1.0]
    later = ValidationTracker()
    later.load_state_dict(tracker.state_dict())
    assert later.add(by_round, progress) == [] and not later.pending(progress)


def test_a_round_split_across_a_buffer_restart_counts_every_group_once():
    """The buffer restarts in the middle of a round: its new session starts with nothing.
    The round is the two sessions' groups, and a group both scored (the new buffer scored
    it again, the old one's report to the coordinator lost with it) counts once."""
    progress = ValidationProgress(rounds_started=1, round_groups=3, head="val.x")
    tracker = ValidationTracker()
    old = _groups([[1.0, 1.0], [0.0, 1.0]])
    assert tracker.add({"val.x/0": old}, progress) == []
    assert tracker.add({}, progress) == []  # the new buffer has nothing yet
    new = _groups([[0.0, 1.0], [0.0, 0.0]], first=1)  # row 1 again, then row 2
    [out] = tracker.add({"val.x/0": new}, progress)
    assert math.isclose(out["val/score"], 3 / 6) and out["val/responses"] == 6


def test_a_learner_restarted_after_a_buffer_restart_keeps_the_old_sessions_groups():
    """The buffer restarts in a round, then the learner restarts from a checkpoint taken
    between: the old session's groups come from the checkpoint (the new buffer never had
    them, and they are not dealt again), so the round still completes."""
    progress = ValidationProgress(rounds_started=1, round_groups=2, head="val.x")
    tracker = ValidationTracker()
    assert tracker.add({"val.x/0": _groups([[1.0, 1.0]])}, progress) == []
    saved = json.loads(json.dumps(tracker.state_dict()))  # as the checkpoint stores it
    restarted = ValidationTracker()
    restarted.load_state_dict(saved)
    [out] = restarted.add({"val.x/0": _groups([[0.0, 0.0]], first=1)}, progress)
    assert math.isclose(out["val/score"], 0.5) and out["val/responses"] == 4
    assert restarted.state_dict()["groups"] == {}  # a reported round's groups are let go


def test_what_else_the_scorer_returned_is_averaged_per_data_source():
    """A scorer returning {"score": ..., "acc": ...}: the round reports the mean of acc per
    data source (veRL's val-aux/<source>/acc/mean@N), over the episodes that carry it."""
    progress = ValidationProgress(rounds_started=1, round_groups=2, head="val.x")
    groups = {
        "val.x/0/0": ValidationGroup.of("a", [1.0, 0.0], 2, [{"acc": 1.0}, {"acc": 0.0}]),
        "val.x/0/1": ValidationGroup.of("a", [1.0, 1.0], 2, [{"acc": 1.0, "fmt": 0.5}, {}]),
    }
    [out] = ValidationTracker().add({"val.x/0": groups}, progress)
    assert math.isclose(out["val/a/acc/mean"], 2 / 3) and out["val/a/fmt/mean"] == 0.5
    assert math.isclose(out["val/a/score"], 0.75)


def test_a_training_batch_reports_the_mean_of_each_part():
    from learner.metrics import reward_part_metrics

    parts = [{"acc": 1.0, "overlong_penalty": -0.5}, {"acc": 0.0}, {}]
    assert reward_part_metrics(parts) == {
        "reward/parts/acc/mean": 0.5,
        "reward/parts/overlong_penalty/mean": -0.5,
    }
    assert reward_part_metrics([{}, {}]) == {}
    # Given the rollouts, over those the trainer keeps, as reward/mean is: an empty response
    # (dropped) scored acc 1 counted in the part's mean before.
    from learner.rollouts import Rollout

    def rollout(n: int) -> Rollout:
        return Rollout([1, 2], [3] * n, [-0.5] * n, reward=1.0, group_id="g")

    parts = [{"acc": 1.0}, {"acc": 0.0}, {"acc": 0.0}]
    kept = reward_part_metrics(parts, [rollout(0), rollout(2), rollout(2)])
    assert kept == {"reward/parts/acc/mean": 0.0}
    assert reward_part_metrics(parts, [rollout(2), rollout(2), rollout(3)], max_len=4) == {
        "reward/parts/acc/mean": 0.5  # the third is past max_len
    }


def test_a_round_says_the_step_whose_weights_it_measured_across_a_coordinator_restore():
    """A round is logged at the step it completes, a step or two after the one whose
    weights it measured (a review found test_freq 15's round logged at step 17 with
    nothing saying so): its record carries ``val/step``, the step it started at, kept
    across a coordinator's checkpoint."""
    from asyncrl.control.admission import Budget
    from asyncrl.control.ledger import TaskLedger
    from asyncrl.control.state import ControlState
    from asyncrl.control.syncs import SyncBook
    from asyncrl.control.task_source import TaskSource
    from asyncrl.tasks import make_row

    def state() -> ControlState:
        rows = [
            make_row("arithmetic", f"{i}+1=", str(i + 1), split="train", index=i) for i in range(4)
        ]
        source = TaskSource(rows, rows[:2], shuffle=False, n=2, lineage="x")
        ledger = TaskLedger(source, Budget(1, 2), lag_retries=1)
        return ControlState(
            ledger, SyncBook(), heartbeat_s=0.5, dead_after_s=2.0, store_host="h",
            store_port=1, test_freq=15,
        )  # fmt: skip

    first = state()
    assert first.on_step(15)
    assert first.on_step(30, weights_step=28)  # sync_every 4: the servers hold step 28's
    second = state()
    second.load_state_dict(first.state_dict())
    progress = second.validation_progress()
    assert progress.start_step(progress.round_key(0)) == 15
    tracker = ValidationTracker()
    rounds = {k: _groups([[1, 0], [0, 0]], round_key=k) for k in ("val.x/0", "val.x/1")}
    assert [r["val/step"] for r in tracker.add(rounds, progress)] == [15, 28]


def test_a_round_is_dealt_once_the_steps_push_ended_and_says_whose_weights_it_measured():
    """A review found a round at a step whose push was still in flight (sync.overlap_push)
    dealt partly at the weights before the push and partly after; and, with sync_every 2
    and test_freq 15, val/step 15 on rounds that measured step 14's weights (step 15 does
    not push). The learner now waits for the push before starting a round, and the round
    says the step whose weights the servers hold."""
    from types import SimpleNamespace

    from asyncrl.control.admission import weights_step
    from learner.control_plane import RankZero

    assert [weights_step(s, 2, 100) for s in (14, 15, 16)] == [14, 14, 16]
    assert weights_step(15, 2, 15) == 15  # the last step always pushes
    # Resumed from step 13's checkpoint: the servers that lived on hold step 12's weights
    assert weights_step(15, 4, 100) == 12 and weights_step(17, 4, 100) == 16
    calls: list[tuple] = []
    plane = SimpleNamespace(
        cfg=SimpleNamespace(trainer=SimpleNamespace(test_freq=15)),
        pushes=SimpleNamespace(serve_catchups=lambda: None, wait=lambda: calls.append(("wait",))),
        coordinator=SimpleNamespace(
            on_step=lambda step, held: calls.append(("on_step", step, held)),
            validation_generating=lambda: False,
        ),
        _weights_step=lambda step: weights_step(step, 2, 100),
        _poll_validation=lambda step: None,
    )
    for step in (14, 15):
        RankZero.after_step(plane, step)  # type: ignore[arg-type]
    assert calls == [("on_step", 14, 14), ("wait",), ("on_step", 15, 14)]


def test_a_round_whose_every_group_was_given_up_reports_no_score():
    """Found by a review: a round with no response logged val/score 0.0, read as a real
    score of zero (more likely since groups of a replaced set lost with a buffer are given
    up); it says how many were given up, and no score."""
    tracker = ValidationTracker()
    progress = ValidationProgress(rounds_started=1, round_groups=2)
    (report,) = tracker.add({}, progress, {"val/0": ["val/0/0", "val/0/1"]})
    assert "val/score" not in report
    assert report["val/responses"] == 0.0 and report["val/groups_given_up"] == 2.0


def test_the_final_round_measures_the_weights_the_run_ends_with_when_the_data_runs_out():
    """A review: with sync_every 2, data spent after step 15 (of 20) left step 15's weights
    unpushed: the final round measured step 14's and reported them as step 15's. The
    learner now pushes them first; a step that pushed, or a resume that trained nothing,
    pushes nothing more."""
    from types import SimpleNamespace

    from learner.loop import LearnerLoop

    def pushes(step: int, started: int = 0) -> int:
        calls: list[int] = []
        loop = SimpleNamespace(
            trainer=SimpleNamespace(step=step, policy_version=1),
            cfg=SimpleNamespace(staleness=SimpleNamespace(sync_every=2)),
            total=20,
            _push=lambda: calls.append(step) or {},
            control=SimpleNamespace(log_step=lambda step, metrics, version: None),
        )
        LearnerLoop._push_final(loop, started)  # type: ignore[arg-type]
        return len(calls)

    assert pushes(15) == 1
    assert pushes(14) == 0 and pushes(20) == 0
    assert pushes(15, started=15) == 0 and pushes(17, started=15) == 1


def test_a_run_whose_data_runs_out_after_a_step_that_did_not_push_pushes_before_it_ends(
    tmp_path,
):
    """The loop itself, not only the rule above: ``run()`` trains until the data is spent
    (after step 3 here, ``sync_every`` 2, so step 3 did not push) and then pushes step 3's
    weights before the final checkpoint and the final round, and records what the push
    returns (a review: it was dropped, the previous push's results with it). A learner restarted at the
    step the data was spent at trains nothing and pushes nothing."""
    from types import SimpleNamespace

    from asyncrl.config import load_config
    from learner.loop import LearnerLoop

    cfg = load_config(None, ["staleness.sync_every=2", "trainer.total_training_steps=20"])

    def run(start: int) -> list[tuple[str, int]]:
        events: list[tuple[str, int]] = []
        trainer = SimpleNamespace(rank=0, world_size=1, step=start, policy_version=1)
        trainer.full_state_for_push = dict

        def one_step() -> bool:
            if trainer.step >= 3:
                return False  # the data is spent
            trainer.step += 1
            return True

        loop = object.__new__(LearnerLoop)
        loop.cfg, loop.trainer, loop.total, loop.run_dir = cfg, trainer, 20, tmp_path
        loop.stopped_by = None
        loop.control = SimpleNamespace(
            resume=lambda state: None,
            version=lambda v: v,
            finish=lambda step, **kw: events.append(("finish", step)),
            log_step=lambda step, metrics, version: events.append((sorted(metrics)[0], step)),
        )
        loop._one_step = one_step  # type: ignore[method-assign]

        def push() -> dict[str, float]:
            events.append(("push", trainer.step))
            return {"sync/probe_max_diff": 0.0}  # the previous push's results among them

        loop._push = push  # type: ignore[method-assign]
        loop._save = lambda final=False: events.append(("save", trainer.step))  # type: ignore[method-assign]
        assert loop.run() == 0
        return events

    # The push's metrics are a record of their own (no later push collects them).
    assert run(0) == [("push", 3), ("sync/probe_max_diff", 3), ("save", 3), ("finish", 3)]
    assert run(3) == [("save", 3), ("finish", 3)]


def test_a_validation_group_the_buffer_dropped_does_not_hold_its_round_for_ever():
    """Found by a review: a validation group the buffer refused (too large for it, or a
    server whose config differs) is dropped for good, not dealt again, and only groups
    given up counted as never coming. Its round was never reported, and the run's ending
    waited out ``launch.start_timeout_s`` for it."""
    from asyncrl.control import Budget, ControlState, TaskSource
    from asyncrl.control.ledger import TaskLedger
    from asyncrl.control.messages import Register
    from asyncrl.control.syncs import SyncBook
    from asyncrl.tasks import make_row
    from asyncrl.wire import DroppedTask
    from learner.validation import never_coming

    def rows(split: str, k: int) -> list[dict]:
        return [
            make_row("arithmetic", f"{i}+{k}=", str(i + k), split=split, index=i)
            for i in range(8 // k)
        ]

    source = TaskSource(rows("train", 1), rows("test", 4), n=2, lineage="")
    st = ControlState(
        TaskLedger(source, Budget(1, 4)),
        SyncBook(),
        heartbeat_s=1.0,
        dead_after_s=60.0,
        store_host="h",
        store_port=0,
        test_freq=5,
        val_before_train=True,
    )
    st.start_run()
    st.register(Register(server_id="s0"), 0.0)
    ids = [t.task_id for t in st.grant("s0", 4, 0.0).tasks if t.validation]
    assert len(ids) == 2
    st.ack("s0", ids, 1.0)
    st.trained([ids[0]])  # scored; the other refused by the buffer
    st.ledger.dropped([DroppedTask(ids[1], "invalid", True)])
    tracker, progress = ValidationTracker(), st.validation_progress()
    states = st.round_states(tracker.missing(progress))
    scored = {
        (key := next(iter(states))): {ids[0]: ValidationGroup.of("arithmetic", [1.0, 0.0], 10)}
    }
    (report,) = tracker.add(scored, progress, never_coming(states))
    assert report["val/groups_given_up"] == 1.0 and report["val/score"] == 0.5
    assert not tracker.pending(progress) and key in tracker.reported


def test_a_round_says_which_policy_versions_its_responses_came_from():
    """Found by a review: pushes go on while a round is generated, so its responses come
    from several versions, and ``val/step`` alone said the round measured one step."""
    tracker = ValidationTracker()
    progress = ValidationProgress(rounds_started=1, round_groups=3)
    groups = {
        "val/0/0": ValidationGroup.of("a", [1.0], 3, versions=(3, 4)),
        "val/0/1": ValidationGroup.of("a", [0.0], 3, versions=(2, 3)),
        "val/0/2": ValidationGroup.of("a", [1.0], 3),  # said nothing (an older buffer's)
    }
    (report,) = tracker.add({"val/0": groups}, progress)
    assert (report["val/version_min"], report["val/version_max"]) == (2.0, 4.0)
    old = ValidationTracker()  # groups that never said: no range, rather than a wrong one
    one = ValidationProgress(rounds_started=1, round_groups=1)
    (report,) = old.add({"val/0": {"val/0/0": ValidationGroup.of("a", [1.0], 3)}}, one)
    assert "val/version_min" not in report


def test_responses_the_scorer_failed_on_are_counted_in_their_round(caplog):
    """Found by a review: a scorer failing on validation responses scored them 0.0 inside
    ``val/score``, and the round's record did not say so. Each failed response now carries
    ``reward_error`` over the wire; the buffer counts a group's failed episodes and the
    round reports ``val/reward_errors``, with a warning."""
    import numpy as np

    from asyncrl.rewards import ScoreResult
    from asyncrl.wire import Group
    from asyncrl.wire.codec import decode_trajectories, encode_trajectories
    from buffer.reports import Reports
    from rollout_servers.groups import scored

    reports = Reports()
    outcomes = [[1.0, None, 0.0, None], [None, None, None, None], [1.0, 1.0, 0.0, 1.0]]
    for row, members in enumerate(outcomes):
        task_id = f"val.x/0/{row}"
        sent = [
            Trajectory.build(
                task_id=task_id,
                prompt_ids=np.arange(3),
                response_ids=np.arange(2),
                logprobs=np.zeros(2),
                group_index=i,
                group_size=len(members),
                validation=True,
                data_source="s",
                **scored(ScoreResult(0.0, error="exception") if r is None else ScoreResult(r)),
            )
            for i, r in enumerate(members)
        ]
        got = decode_trajectories(encode_trajectories(sent))
        reports.scored(Group.from_trajectories(task_id, got))
    progress = ValidationProgress(rounds_started=1, round_groups=3, head="val.x")
    with caplog.at_level("WARNING", logger="learner.validation"):
        [out] = ValidationTracker().add(reports.results_for([]), progress)
    assert out["val/reward_errors"] == 6.0 and out["val/responses"] == 12
    assert math.isclose(out["val/score"], 4 / 12)  # the failures are in it, as 0.0
    assert "the scorer failed on 6 of its 12 responses" in caplog.text
    one = ValidationProgress(rounds_started=1, round_groups=1, head="val.x")
    [clean] = ValidationTracker().add({"val.x/0": _groups([[1.0, 0.0]])}, one)
    assert clean["val/reward_errors"] == 0.0
