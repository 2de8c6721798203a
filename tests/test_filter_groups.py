"""DAPO's dynamic sampling and overlong shaping: the pure rules, the coordinator's half
(budget, accounting, the bound) driven by hand with the real ledger and buffer, and a
launched run in which every group is filtered."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import msgspec
import pytest

from asyncrl.config import load_config
from asyncrl.config.recipes import OverlongBufferConfig
from asyncrl.control import messages as m
from asyncrl.control.group_filter import GroupFilter
from asyncrl.rewards import ScoreResult
from asyncrl.rewards.shaping import has_signal, metric_value, overlong_penalty
from rollout_servers import agent as agent_module
from rollout_servers import server as server_module
from rollout_servers import task_groups
from rollout_servers.groups import filtered_out, shape_overlong, unknown_filter_metric
from rollout_servers.server import RolloutServer
from tests.helpers import wait_until_async
from tests.standins.chat import CharTokenizer
from tests.standins.server_parts import (  # noqa: F401 (nap_tools: a fixture)
    N,
    StandInClient,
    StandInEngine,
    StandInPusher,
    StandInScorer,
    ToolCallingEngine,
    agent_runner,
    nap_tools,
)
from tests.test_accounting import B, Run, _group

# ------------------------------------------------------------------ the pure rules


def dapo_penalty(valid_response_length: int, max_resp_len: int, buffer_len: int, factor: float):
    """DAPO's reward manager, as its paper and veRL write it."""
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / buffer_len * factor, 0)


@pytest.mark.parametrize("length", [0, 1, 12, 15, 16, 17, 19, 20])
@pytest.mark.parametrize(("buffer_len", "factor"), [(4, 1.0), (8, 0.5), (20, 2.0)])
def test_overlong_penalty_equals_dapos_on_a_table_of_lengths(length, buffer_len, factor):
    got = overlong_penalty(length, 20, buffer_len, factor)
    assert got == pytest.approx(dapo_penalty(length, 20, buffer_len, factor), abs=1e-12)
    assert -factor <= got <= 0.0


def test_overlong_penalty_at_the_limit_and_before_the_buffer():
    assert overlong_penalty(20, 20, 4, 1.0) == -1.0  # truncated at the limit: full penalty
    assert overlong_penalty(16, 20, 4, 1.0) == 0.0  # the buffer starts after 16 tokens
    assert overlong_penalty(18, 20, 4, 1.0) == -0.5
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # len 0: off


def test_shaping_keeps_the_penalty_as_a_part_and_the_unshaped_score():
    cfg = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    shaped = shape_overlong([ScoreResult(1.0), ScoreResult(0.0, {"acc": 0.0})], [20, 10], 20, cfg)
    assert [s.score for s in shaped] == [0.0, 0.0]
    assert shaped[0].parts["overlong_penalty"] == -1.0 and shaped[1].parts["acc"] == 0.0
    assert [s.unshaped for s in shaped] == [1.0, 0.0]
    off = OverlongBufferConfig(enable=False, len=4, penalty_factor=1.0)
    assert shape_overlong([ScoreResult(1.0)], [20], 20, off)[0].score == 1.0


def test_signal_and_metrics():
    assert not has_signal([1.0, 1.0, 1.0]) and has_signal([1.0, 0.0]) and has_signal([0.5])
    assert has_signal([1.0, math.nan])  # an unknown metric keeps the group
    assert metric_value("acc", 1.0, 0.5, {}) == 1.0  # no acc part: the score
    assert metric_value("acc", 1.0, 0.5, {"acc": 0.0}) == 0.0
    assert metric_value("score", 1.0, 0.5, {}) == 1.0
    assert metric_value("seq_reward", 1.0, 0.5, {}) == 0.5
    assert math.isnan(metric_value("format", 1.0, 1.0, {}))


def test_the_filter_compares_the_chosen_metric():
    """Two members right, one overlong: the shaped rewards differ (seq_reward keeps the
    group), the scores do not (acc/score drop it); validation is never filtered."""
    task = m.Task(task_id="train/0/0", data_source="a", prompt=[], ground_truth="1", n=2)
    cfg = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    scores = shape_overlong([ScoreResult(1.0), ScoreResult(1.0)], [3, 20], 20, cfg)
    on = m.Task(**{**_fields(task), "filter": True})
    assert filtered_out(on, scores, "acc") and filtered_out(on, scores, "score")
    assert not filtered_out(on, scores, "seq_reward")
    assert not filtered_out(task, scores, "acc")  # dealt without the filter
    val = m.Task(**{**_fields(task), "filter": True, "validation": True, "task_id": "val/0/0"})
    assert not filtered_out(val, scores, "acc")


def test_a_group_the_scorer_failed_on_throughout_is_kept():
    """Found by a review: a scorer failing on every sample (a missing import, a key absent
    from extra_info) scored each 0.0, so every group was alike and filtered: the run
    generated on and never trained a step, no step record showed rollout/reward_errors,
    and the coordinator's line blamed the prompts. Such a group is kept (one member the
    scorer did not fail on makes it an ordinary group again)."""
    task = m.Task(task_id="train/0/0", data_source="a", prompt=[], ground_truth="1", n=4)
    on = m.Task(**{**_fields(task), "filter": True})
    failed = [ScoreResult(0.0, {}, "exception") for _ in range(4)]
    assert not filtered_out(on, failed, "acc") and not filtered_out(on, failed, "score")
    assert filtered_out(on, [*failed[:3], ScoreResult(0.0)], "acc")


def test_a_group_all_wrong_with_one_penalised_member_is_filtered():
    """Every member scored -1.0 and one ran into the overlong buffer (len 1000 of 8192):
    the scores are alike and the group is dropped. Read back as the shaped score minus the
    penalty, that member's score was -0.9999999999999999, and the group was kept."""
    task = m.Task(task_id="train/0/0", data_source="a", prompt=[], ground_truth="1", n=4)
    on = m.Task(**{**_fields(task), "filter": True})
    cfg = OverlongBufferConfig(enable=True, len=1000, penalty_factor=1.0)
    raw = [ScoreResult(-1.0) for _ in range(4)]
    scores = shape_overlong(raw, [100, 200, 7193, 300], 8192, cfg)
    assert scores[2].score - scores[2].parts["overlong_penalty"] != -1.0  # the round trip
    assert filtered_out(on, scores, "acc") and filtered_out(on, scores, "score")
    assert not filtered_out(on, scores, "seq_reward")  # the shaped rewards do differ


def _fields(task: m.Task) -> dict:
    return {f: getattr(task, f) for f in task.__struct_fields__}


# ------------------------------------------------------------------ the coordinator


def _filtering_run(max_num_gen_batches: int) -> Run:
    run = Run(0)
    run.st.group_filter = GroupFilter(
        enable=True, max_num_gen_batches=max_num_gen_batches, batch_size=B
    )
    return run


def test_the_bound_counts_generation_batches_of_data_gen_batch_size_as_veRL():
    """DAPO's recipe sets data.gen_batch_size (3 times the batch): the bound counts its
    batches, as veRL's does (it counted batches of data.train_batch_size, a third of
    veRL's search, while the key was taken as one with no effect)."""
    from asyncrl.control.setup import state_from_config
    from tests.test_pacing import _rows

    on = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"]
    dapo = load_config("configs/cpu_demo.yaml", [*on, "data.gen_batch_size=48"])
    state = state_from_config(dapo, _rows(8), _rows(2, "test"))
    assert state.group_filter.bound == 2 * 48
    plain = state_from_config(load_config("configs/cpu_demo.yaml", on), _rows(8), _rows(2, "test"))
    assert plain.group_filter.bound == 2 * 16  # unset: batches of data.train_batch_size


def _serve(run: Run, alike: set[int]) -> tuple[int, int]:
    """The server takes what is granted; a task whose position is in ``alike`` has a
    group that scores alike and is filtered (if dealt with the filter on). Returns
    (filtered, pushed)."""
    filtered = pushed = 0
    while True:
        grant = run.st.grant("s", 64, 0.0)
        if not grant.tasks:
            return filtered, pushed
        for t in grant.tasks:
            if t.filter and int(t.task_id.rsplit("/", 1)[1]) in alike:
                reply = run.st.ack("s", [t.task_id], 0.0, filtered=True)
                assert reply.acked == [t.task_id]
                filtered += 1
            else:
                run.buf.add_packed(_group(t, run.st.version), 0.0)
                run.st.ack("s", [t.task_id], 0.0)
                pushed += 1


def test_filtered_groups_free_their_budget_at_once_and_are_accounted():
    run = _filtering_run(0)
    filtered, pushed = _serve(run, alike=set(range(0, 40, 2)))  # every other prompt
    # lag 0: the budget is one batch of B; each filtered group made room for another
    assert pushed == B and filtered == B
    assert run.step()
    a = run.acct()
    assert a["accounting/train/dropped/filtered"] == filtered
    assert a["accounting/train/dealt"] == filtered + pushed
    m_ = run.st.metrics()
    assert m_["filter/filtered_frac"] == pytest.approx(0.5)
    assert m_["filter/prompts_per_trained_group"] == pytest.approx(2.0)
    assert run.st.ledger.refunded["filtered"] == filtered


def _dealt_twice(run: Run) -> tuple[m.Task, m.Task]:
    """A task dealt to server "s" with the filter on, failed there, and dealt to it again."""
    (task,) = run.st.grant("s", 1, 0.0).tasks
    assert task.filter and run.st.nack("s", [task.task_id], "boom", 0.0, [task.attempt]) == 1
    again = next(t for t in run.st.grant("s", 64, 0.0).tasks if t.task_id == task.task_id)
    assert again.attempt == task.attempt + 1 and again.filter
    return task, again


def test_a_filtered_report_sent_again_does_not_end_the_tasks_next_deal():
    """Found by a review: an acknowledgement of a filtered group named no deal, so one of
    an earlier deal (sent again after a lost reply, while the task was dealt to the same
    server again) ended the new deal as filtered, whose own group then came back
    "unknown". It names its deal now, as a failure report does."""
    run = _filtering_run(0)
    task, again = _dealt_twice(run)
    late = run.st.ack("s", [task.task_id], 0.0, filtered=True, attempts=[task.attempt])
    assert late.acked == [] and late.unknown == [task.task_id]
    assert run.st.ledger.is_out(task.task_id)
    assert run.st.ledger.counts["filtered_of_earlier_deals"] == 1
    now = run.st.ack("s", [again.task_id], 0.0, filtered=True, attempts=[again.attempt])
    assert now.acked == [again.task_id]
    assert run.acct()["accounting/train/dropped/filtered"] == 1


def test_past_the_bound_tasks_are_dealt_unfiltered_and_it_says_so_once(caplog):
    """Every group scores alike: after max_num_gen_batches batches' worth are filtered the
    tasks come unfiltered, the learner trains them, and the filter is on again."""
    run = _filtering_run(2)
    with caplog.at_level("WARNING", logger="asyncrl.control.group_filter"):
        filtered, pushed = _serve(run, alike=set(range(1000)))
    assert filtered == 2 * B and pushed == B
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "max_num_gen_batches=2" in lines[0], lines
    assert not run.st.group_filter.active
    assert run.step()  # trains what came
    assert run.st.group_filter.active
    assert run.st.metrics()["filter/bound_hits"] == 1
    run.acct()


def test_the_filters_counts_survive_a_coordinator_restore():
    """Saved with the coordinator's state: a resumed run's filter/* go on, and the bound
    keeps counting the groups filtered since the last trained step."""
    run = _filtering_run(2)
    _serve(run, alike=set(range(1000)))  # past the bound: 2 batches filtered, then dealt
    saved = run.st.state_dict()
    again = _filtering_run(2)
    again.st.load_state_dict(saved)
    gf = again.st.group_filter
    assert (gf.since_step, gf.total, gf.bound_hits) == (2 * B, 2 * B, 1)
    assert not gf.active  # still past the bound: the next step's batch comes unfiltered
    assert again.st.metrics()["filter/groups_filtered"] == 2 * B


def test_validation_tasks_are_never_dealt_filtered():
    run = _filtering_run(0)
    run.st.validation.test_freq = 1
    run.st.validation.val_before_train = True
    tasks = [t for t in run.st.grant("s", 64, 0.0).tasks]
    assert tasks and all(t.filter for t in tasks if not t.validation)
    assert all(not t.filter for t in tasks if t.validation)


# ------------------------------------------------------------------ a launched run


def _demo_launch(tmp_path, model, data, name: str, steps: int) -> list[str]:
    """``asyncrl-launch`` of the demo on the test's model and data, without validation or
    checkpoints, its run under ``tmp_path/runs/asyncrl/<name>``."""
    return [
        sys.executable, "-m", "asyncrl.launch", "configs/cpu_demo.yaml",
        f"model.path={model}",
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
        f"trainer.default_local_dir={tmp_path / 'runs'}", f"trainer.experiment_name={name}",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
    ]  # fmt: skip


SCORER = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
)


@pytest.mark.slow
def test_a_run_where_every_group_is_filtered_ends_with_the_line(
    tmp_path, demo_model, arithmetic_data
):
    """Every response scores 0: every group is filtered until the bound (one batch), then
    the run trains what comes and ends; the accounting identity holds with the reason."""
    scorer = tmp_path / "zero.py"
    scorer.write_text(SCORER)
    cmd = [
        *_demo_launch(tmp_path, demo_model, arithmetic_data, "f", steps=3),
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1",
        f"reward.custom_reward_function.path={scorer}",
        "trainer.health.enable=false",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "asyncrl" / "f"
    learner_log = (run / "logs" / "learner.log").read_text()
    assert "filter_groups:" in learner_log and "max_num_gen_batches=1" in learner_log
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss/pg" in r]
    assert steps[-1]["learner/step"] == 3 and steps[-1]["filter/bound_hits"] >= 1
    last = records[-1]  # the final accounting
    assert last["accounting/train/dropped/filtered"] >= 16
    assert last["accounting/train/unaccounted"] == 0
    assert "dropped" in proc.stdout + proc.stderr and "filtered" in proc.stdout + proc.stderr


# ------------------------------------------------------------------ the rollout server


class FilteringClient(StandInClient):
    """Deals every task with the filter on (``on``; ``agent``: as multi-turn tool episodes)
    and records which ones the server reported filtered."""

    def __init__(self, tasks: int, agent: bool, on: bool = True) -> None:
        super().__init__(tasks)
        self.agent, self.on = agent, on
        self.filtered: list[str] = []
        self.too_long: list[str] = []
        self.dealt: list[int] = []  # the attempts the filtered reports named
        self.sessions: list[str] = []  # and the coordinator sessions that dealt them

    def request_tasks(
        self, max_tasks: int | None = None, wait_s: float | None = None, max_samples: int = 0
    ) -> m.TaskGrant:
        grant = super().request_tasks(max_tasks, wait_s, max_samples)
        name = "tool_agent" if self.agent else "single_turn"
        tasks = [
            msgspec.structs.replace(t, filter=self.on, agent_name=name, dealt_session="c1")
            for t in grant.tasks
        ]
        return m.TaskGrant(tasks=tasks, policy_version=0)

    def ack(
        self,
        task_ids: list[str],
        attempts: int = 3,
        filtered: bool = False,
        prompt_too_long: bool = False,
        dealt: list[int] | None = None,
        session: str = "",
    ) -> object:
        if filtered:
            self.filtered += task_ids
            self.dealt += dealt or []
            self.sessions.append(session)
        if prompt_too_long:
            self.too_long += task_ids
        return super().ack(task_ids)


def _run_server(
    client: StandInClient,
    overrides: list[str],
    agent=None,
    counters: dict | None = None,
    acks: int = 4,
) -> StandInPusher:
    cfg = load_config(None, [f"rollout.n={N}", "rollout.max_inflight=8", *overrides])
    engine = ToolCallingEngine() if agent is not None else StandInEngine()
    engine.gate.set()
    pusher = StandInPusher()
    srv = RolloutServer(
        cfg, "s", engine, CharTokenizer(), StandInScorer(), pusher, client, agent=agent
    )

    async def scenario() -> None:
        run = asyncio.create_task(srv.run())
        await wait_until_async(lambda: len(client.acked) == acks, "every group reported", 20)
        srv.stop()
        assert await asyncio.wait_for(run, 5.0) == 0

    asyncio.run(scenario())
    if counters is not None:
        counters.update(srv.metrics)
    return pusher


@pytest.mark.parametrize("episodes", [False, True], ids=["single_turn", "tool_agent"])
def test_the_server_filters_alike_groups_without_pushing(monkeypatch, nap_tools, episodes):  # noqa: F811
    """Every member scores 1.0: each group is reported filtered and none crosses the wire,
    for single-turn groups and multi-turn tool episodes alike."""
    monkeypatch.setattr(task_groups, "sampling_params", lambda settings, task, index: None)
    monkeypatch.setattr(agent_module, "turn_params", lambda *args: None)
    client = FilteringClient(tasks=4, agent=episodes)
    agent = agent_runner(ToolCallingEngine(), nap_tools) if episodes else None
    pusher = _run_server(client, ["algorithm.filter_groups.enable=true"], agent)
    assert len(client.filtered) == 4 and pusher.groups == []
    assert client.dealt == [0] * 4  # each report names its deal (a resend cannot end the next)
    assert client.sessions == ["c1"] * 4  # ... and the coordinator that dealt it


class StallingClient(FilteringClient):
    """A coordinator that stalls: the first ``stalled`` filtered acknowledgements go
    unanswered (the client's retries spent), as ``CoordinatorClient.ack`` returns None."""

    def __init__(self, tasks: int, stalled: int) -> None:
        super().__init__(tasks, agent=False)
        self.stalled = stalled
        self.named: list[str] = []

    def ack(self, task_ids: list[str], attempts: int = 3, **flags: bool) -> object:
        reply = super().ack(task_ids, attempts, **flags)
        if flags.get("filtered") and self.stalled > 0:
            self.stalled -= 1
            # Of the unanswered ones, those a registration now would name.
            self.named += [t for t in task_ids if t in self.held_tasks()]
            return None
        return reply


def test_a_filtered_groups_unanswered_ack_is_sent_again(monkeypatch):
    """Found by a review: a filtered group's acknowledgement that the coordinator never
    answered was not sent again, and nothing else frees the group's admission budget but
    ``control.task_timeout_s`` (30 min): a stall under a filter that drops most groups shut
    the window that long. Unanswered, it is sent again until answered."""
    monkeypatch.setattr(task_groups, "sampling_params", lambda settings, task, index: None)
    monkeypatch.setattr(server_module, "ACK_AGAIN_S", 0.05)
    client = StallingClient(tasks=4, stalled=3)
    counters: dict = {}
    pusher = _run_server(
        client, ["algorithm.filter_groups.enable=true"], counters=counters, acks=4 + 3
    )
    assert pusher.groups == [] and client.stalled == 0
    assert sorted(set(client.filtered)) == sorted(set(client.acked)) and len(client.acked) == 4 + 3
    assert len(client.filtered) == 4 + 3  # each unanswered one was sent once more
    assert counters["rollout/dropped_acks_resent"] == 3
    # Meanwhile a registration (a restarted coordinator) would not name them: adopted
    # after this report was answered "unknown", they would wait out task_timeout_s.
    assert client.named == []


def test_a_filter_metric_the_scorer_does_not_return_is_counted_and_named(monkeypatch, caplog):
    """veRL raises a KeyError on a metric no member carries; here the groups are kept (no
    batch empties on a typo), the server counts them and says once what to use."""
    monkeypatch.setattr(task_groups, "sampling_params", lambda settings, task, index: None)
    client = FilteringClient(tasks=4, agent=False)
    counters: dict = {}
    on = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=accuracy"]
    with caplog.at_level("WARNING", logger="rollout_servers.server"):
        pusher = _run_server(client, on, counters=counters)
    assert client.filtered == [] and len(pusher.groups) == 4
    assert counters["rollout/filter_metric_unknown"] == 4
    lines = [r.getMessage() for r in caplog.records if "filter_groups.metric" in r.getMessage()]
    assert len(lines) == 1 and "'accuracy' is not among what the scorer returns" in lines[0]
    assert "use acc, score, seq_reward" in lines[0]
    # The names that always exist, and a part one member returns, are known.
    task = m.Task(task_id="train/0/0", data_source="a", prompt=[], ground_truth="1", n=2)
    on_task = m.Task(**{**_fields(task), "filter": True})
    plain = [ScoreResult(1.0), ScoreResult(0.0)]
    assert all(unknown_filter_metric(on_task, plain, k) is None for k in ("acc", "score"))
    with_part = [ScoreResult(1.0, parts={"pass": 1.0}), ScoreResult(0.0)]
    assert unknown_filter_metric(on_task, with_part, "pass") is None
    assert unknown_filter_metric(task, plain, "accuracy") is None  # dealt unfiltered


def test_overlong_shaping_penalises_responses_at_the_limit(monkeypatch):
    """Responses of 3 tokens with max_response_length 4 and a buffer of 2: each reward
    1.0 loses 0.5, recorded as its overlong_penalty part; the group is pushed."""
    monkeypatch.setattr(task_groups, "sampling_params", lambda settings, task, index: None)
    client = StandInClient(tasks=4)
    shaping = [
        "data.max_response_length=4",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=2",
        "reward.overlong_buffer.penalty_factor=1.0",
    ]
    pusher = _run_server(client, shaping)
    trajs = [t for group in pusher.groups for t in group]
    assert len(trajs) == 4 * N
    assert {t.reward for t in trajs} == {0.5}
    assert {t.meta.reward_parts["overlong_penalty"] for t in trajs} == {-0.5}


def test_a_prompt_over_the_limit_is_dropped_at_the_server(monkeypatch):
    """data.filter_overlong_prompts: a training prompt of 3 tokens over a limit of 2 is
    reported filtered, never generated, never pushed."""
    monkeypatch.setattr(task_groups, "sampling_params", lambda settings, task, index: None)
    client = FilteringClient(tasks=4, agent=False)
    limits = ["data.max_prompt_length=2", "data.filter_overlong_prompts=true"]
    pusher = _run_server(client, limits)
    assert len(client.filtered) == 4 and pusher.groups == []
    assert client.too_long == client.filtered  # said apart from the group filter's drops


def test_a_prompt_dropped_as_too_long_is_no_verdict_of_the_group_filter():
    """A review: prompts dropped by data.filter_overlong_prompts were acknowledged as the
    group filter's drops, so they counted toward max_num_gen_batches (switching the filter
    off early) and raised the prompts' skip streaks. Judged not, and accounted under their
    own reason: the accounting line read "dropped (filtered)" in a run without the filter."""
    run = _filtering_run(1)
    grant = run.st.grant("s", 2, 0.0)
    (long, alike) = [t.task_id for t in grant.tasks]
    run.st.ack("s", [long], 0.0, filtered=True, prompt_too_long=True)
    gf = run.st.group_filter
    assert (gf.since_step, gf.total) == (0, 0) and gf.active
    run.st.ack("s", [alike], 0.0, filtered=True)
    assert (gf.since_step, gf.total) == (1, 1)
    acct = run.acct()
    assert acct["accounting/train/dropped/filtered"] == 1
    assert acct["accounting/train/dropped/prompt_too_long"] == 1
    assert acct["accounting/train/unaccounted"] == 0


def test_overlong_shaping_measures_a_split_episode_by_its_whole_response(monkeypatch, nap_tools):  # noqa: F811
    """An episode split in two samples of 1 sampled token (a template that rewrites
    history), the second opened by a tool answer of 1 token, with max_response_length 4
    and a buffer of 2: the episode's response is all 3 tokens, one past the buffer's start,
    so the penalty is -0.5. Each sample used to have a budget of its own and the penalty
    measured the longest (1 token: none)."""
    from rollout_servers.episodes import Episode, Piece

    def piece(lead: int) -> Piece:
        return Piece([1, 7], [5], [-0.1], version_spans=[(0, 1)], finish_reason="stop", lead=lead)

    async def split_episode(task, index):
        return Episode(pieces=[piece(0), piece(1)], messages=[], turns=2, splits=1)

    client = FilteringClient(tasks=4, agent=True, on=False)
    agent = agent_runner(ToolCallingEngine(), nap_tools)
    monkeypatch.setattr(agent, "episode", split_episode)
    shaping = [
        "data.max_response_length=4",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=2",
        "reward.overlong_buffer.penalty_factor=1.0",
    ]
    pusher = _run_server(client, shaping, agent)
    rewards = {t.reward for group in pusher.groups for t in group}
    assert len(pusher.groups) == 4 and rewards == {0.5}, rewards


def test_the_data_spent_line_names_the_group_filter_when_it_is_on():
    """A review: with the step total derived from the data, a filtered run ends short of it
    (filtered groups never train), and the line named only rows dropped as too long."""
    from learner.control_plane import _spent_fix

    derived = ["trainer.total_training_steps=null"]
    off = _spent_fix(load_config(None, derived))
    on = _spent_fix(load_config(None, [*derived, "algorithm.filter_groups.enable=true"]))
    assert "filter_groups" not in off and "groups dropped by algorithm.filter_groups" in on
