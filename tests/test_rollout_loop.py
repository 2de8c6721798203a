"""The rollout server's loop with stand-ins for its collaborators (no vLLM, no sockets): it
sleeps while its slots are full instead of polling, takes the next tasks as soon as a group
finishes, stops at once when told, and keeps bounded windows of recent rewards and lengths.
The stand-ins (:mod:`tests.standins.server_parts`) satisfy the protocols in
:mod:`rollout_servers.protocols`, which a type checker holds them to (see the typed
assignments in :func:`_server`)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from asyncrl.config import load_config
from asyncrl.rewards import ScoreResult
from rollout_servers import agent as agent_module
from rollout_servers import protocols, task_groups
from rollout_servers.samples import Sample
from rollout_servers.server import RolloutServer
from rollout_servers.server_stats import RECENT
from tests.helpers import wait_until_async
from tests.standins.chat import CharTokenizer
from tests.standins.server_parts import (  # noqa: F401 (nap_tools: a fixture)
    NAP_S,
    RESPONSE,
    N,
    StandInClient,
    StandInEngine,
    StandInPusher,
    StandInScorer,
    SyncingClient,
    ToolCallingEngine,
    agent_runner,
    make_task,
    nap_tools,
)


def _server(client: StandInClient, max_inflight: int) -> tuple[RolloutServer, StandInEngine]:
    cfg = load_config(None, [f"rollout.n={N}", f"rollout.max_inflight={max_inflight}"])
    engine = StandInEngine()
    parts: tuple[
        protocols.GenerationEngine,
        protocols.Tokenizer,
        protocols.Scorer,
        protocols.GroupPusher,
        protocols.ControlClient,
    ] = (engine, CharTokenizer(), StandInScorer(), StandInPusher(), client)
    kinds = (
        protocols.GenerationEngine,
        protocols.Tokenizer,
        protocols.Scorer,
        protocols.GroupPusher,
        protocols.ControlClient,
    )
    for part, protocol in zip(parts, kinds, strict=True):
        assert isinstance(part, protocol), f"{type(part).__name__} is no {protocol.__name__}"
    return RolloutServer(cfg, "s", *parts), engine


@pytest.fixture(autouse=True)
def _no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling parameters are the engine's business; importing vLLM for them takes seconds."""
    monkeypatch.setattr(task_groups, "sampling_params", lambda settings, task, index: None)


def test_full_slots_wait_without_polling_and_wake_when_a_group_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> None:
        client = StandInClient(tasks=2)
        srv, engine = _server(client, max_inflight=N)  # one group fills every slot
        checks = 0  # of the free slots: once or twice per turn of the task loop
        free = srv._free

        def counted() -> int:
            nonlocal checks
            checks += 1
            return free()

        monkeypatch.setattr(srv, "_free", counted)
        run = asyncio.create_task(srv.run())
        await wait_until_async(lambda: engine.requests == N, "the first group to start", 5)
        assert len(client.requests) == 1 and srv.inflight == N
        checks = 0
        await asyncio.sleep(0.5)
        # Polling every 10 ms made ~50 checks; waiting wakes only for the 1 s report.
        assert checks <= 2, checks
        assert len(client.requests) == 1  # no task asked for while no slot is free
        engine.gate.set()
        finished = time.monotonic()
        await wait_until_async(lambda: len(client.acked) == 2, "both groups", 5)
        # The freed slots were taken at once: without the wake-up the loop would only look
        # at its next report, 1 s later. 0.6 s leaves a loaded machine room and still
        # tells the two apart.
        assert client.requests[1] - finished < 0.6
        srv.stop()
        assert await asyncio.wait_for(run, 2.0) == 0

    asyncio.run(scenario())


def test_stop_wakes_a_loop_whose_slots_are_full() -> None:
    async def scenario() -> None:
        client = StandInClient(tasks=1)
        srv, engine = _server(client, max_inflight=N)
        run = asyncio.create_task(srv.run())
        await wait_until_async(lambda: engine.requests == N, "the group to start", 5)
        stopped = time.monotonic()
        srv.stop()
        assert await asyncio.wait_for(run, 2.0) == 0
        # Woken by the stop, not by its next report (1 s): see above for the margin.
        assert time.monotonic() - stopped < 0.6
        assert client.acked == []  # the unfinished group was cancelled, not pushed

    asyncio.run(scenario())


def test_recent_windows_are_bounded() -> None:
    srv, _ = _server(StandInClient(tasks=0), max_inflight=N)
    sample = Sample(list(RESPONSE), [-0.5] * 3, [(0, 3)], "stop")
    for i in range(RECENT):  # 2 * RECENT responses: the first half scored 0, then 1
        score = ScoreResult(float(i >= RECENT // 2))
        srv.stats.count_group([sample, sample], [score, score], make_task(f"train/0/{i}"))
    assert len(srv.stats.rewards) == len(srv.stats.lengths) == RECENT
    assert srv.snapshot()["rollout/reward_mean"] == 1.0  # only the latest RECENT responses
    assert srv.snapshot()["rollout/response_length_mean"] == len(RESPONSE)
    # Validation groups are not training's (a review: a round scored 1 moved the training
    # reward from 0 to 0.6 in the check); val/* measure them.
    short = Sample([7], [-0.5], [(0, 1)], "stop")
    for i in range(RECENT):
        val = msgspec.structs.replace(make_task(f"val/0/{i}"), validation=True)
        srv.stats.count_group([short], [ScoreResult(0.0)], val)
    assert srv.snapshot()["rollout/reward_mean"] == 1.0
    assert srv.snapshot()["rollout/response_length_mean"] == len(RESPONSE)


def test_a_weight_sync_is_not_delayed_by_queued_tool_calls(monkeypatch, nap_tools):  # noqa: F811
    """Episodes waiting for a tool worker must not hold the threads the server's control
    calls need: a sync start is picked up within its 0.2 s poll, not after the tool queue
    (16 tool calls of 0.5 s on 2 workers: 4 s) drains."""
    monkeypatch.setattr(agent_module, "turn_params", lambda *args: None)

    async def scenario() -> None:
        # The default executor of a small machine (min(32, cores + 4) threads).
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4))
        client = SyncingClient(tasks=8)
        engine = ToolCallingEngine()
        cfg = load_config(None, [f"rollout.n={N}", "rollout.max_inflight=16"])
        srv = RolloutServer(
            cfg,
            "s",
            engine,
            CharTokenizer(),
            StandInScorer(),
            StandInPusher(),
            client,
            agent=agent_runner(engine, nap_tools),
        )
        run = asyncio.create_task(srv.run())
        # Every episode's first turn is sampled: all 16 wait for a tool worker now.
        await wait_until_async(lambda: engine.requests >= 16, "every episode's first turn", 10)
        queued = time.monotonic()  # the sync loop's next poll starts after this
        polled = lambda: client.polls_ended and client.polls_ended[-1] > queued  # noqa: E731
        await wait_until_async(polled, "the sync loop's poll under way to end", 10)
        asked = time.monotonic()
        client.sync.set()
        await wait_until_async(lambda: engine.synced_at, "the sync to reach the engine", 10)
        await wait_until_async(client.sync_reported.is_set, "the sync report", 10)
        assert engine.synced_at - asked < 1.0, f"waited {engine.synced_at - asked:.1f} s"
        await wait_until_async(lambda: len(client.acked) == 8, "every group", 20)
        srv.stop()
        assert await asyncio.wait_for(run, 5.0) == 0

    asyncio.run(scenario())


def test_waiting_for_a_tool_worker_ends_at_the_episode_deadline(
    monkeypatch,
    nap_tools,  # noqa: F811
) -> None:
    """16 episodes of one tool call each on 2 workers would take 4 s; with a 1 s deadline
    the episodes still queued end at their deadline (``timeout``), not after the queue."""
    monkeypatch.setattr(agent_module, "turn_params", lambda *args: None)
    runner = agent_runner(ToolCallingEngine(), nap_tools, timeout_s=1.0)
    task = msgspec.structs.replace(make_task("calc-0"), n=16, agent_name="tool_agent")

    async def scenario() -> float:
        start = time.monotonic()
        await asyncio.gather(*[runner.episode(task, i) for i in range(task.n)])
        return time.monotonic() - start

    took = asyncio.run(scenario())
    assert took < 1.0 + 2 * NAP_S, f"{took:.1f} s"
    assert runner.metrics["rollout/agent/episodes_ended/timeout"] >= 8


def test_samples_the_scorer_fails_on_are_counted(tmp_path) -> None:
    """A scorer that raises scores every sample 0.0 (the run goes on); each failure is
    counted in ``rollout/reward_errors``, which reaches the run's records: a walkthrough's
    run with such a scorer ended "successfully" at reward 0 with one line in a server log."""
    from asyncrl.rewards import RewardPool

    scorer = tmp_path / "score.py"
    scorer.write_text("def compute_score(*args, **kwargs):\n    raise RuntimeError('bug')\n")

    async def scenario(pool: RewardPool) -> None:
        client = StandInClient(tasks=2)
        cfg = load_config(None, [f"rollout.n={N}", f"rollout.max_inflight={2 * N}"])
        engine = StandInEngine()
        engine.gate.set()
        pusher = StandInPusher()
        srv = RolloutServer(cfg, "s", engine, CharTokenizer(), pool, pusher, client)
        run = asyncio.create_task(srv.run())
        await wait_until_async(lambda: len(client.acked) == 2, "both groups", 20)
        srv.stop()
        assert await asyncio.wait_for(run, 5.0) == 0
        assert srv.metrics["rollout/reward_errors"] == 2 * N
        # Each pushed response says so, for validation rounds to count (val/reward_errors)
        pushed = [t for group in pusher.groups for t in group]
        assert len(pushed) == 2 * N and all(t.meta.reward_error for t in pushed)

    pool = RewardPool(num_workers=1, timeout_s=10, custom_path=str(scorer))
    try:
        asyncio.run(scenario(pool))
        assert pool.counters["exception"] == 2 * N
    finally:
        pool.close()


class _SlowScorer(StandInScorer):
    def score_many(self, items):
        time.sleep(0.3)
        return super().score_many(items)


class _SlowPusher(StandInPusher):
    async def send_async(self, trajectories, timeout_s=None) -> float:
        await asyncio.sleep(0.2)
        return await super().send_async(trajectories, timeout_s)


def test_time_the_engine_idles_on_the_scorer_or_the_buffer_is_not_generation() -> None:
    """A group generated at once then scored for 0.3 s and pushed for 0.2 s: with nothing
    else in flight, the engine idles through both, counted as ``rollout/score_wait_s`` and
    ``rollout/push_blocked_s`` (the time split's "waiting for the scorer"; before, a slow
    reward function looked like generation)."""

    async def scenario() -> dict[str, float]:
        client = StandInClient(tasks=1)
        cfg = load_config(None, [f"rollout.n={N}", f"rollout.max_inflight={4 * N}"])
        engine = StandInEngine()
        engine.gate.set()
        srv = RolloutServer(cfg, "s", engine, CharTokenizer(), _SlowScorer(), _SlowPusher(), client)
        run = asyncio.create_task(srv.run())
        await wait_until_async(lambda: len(client.acked) == 1, "the group", 10)
        srv.stop()
        assert await asyncio.wait_for(run, 5.0) == 0
        return srv.snapshot()

    m = asyncio.run(scenario())
    assert 0.25 <= m["rollout/score_wait_s"] < 2.0, m
    assert 0.15 <= m["rollout/push_blocked_s"] < 2.0, m
    assert 0.0 < m["rollout/score_wait_fraction"] <= 1.0  # the live line's "scorer wait"


def test_a_failed_sync_loop_stops_the_server_to_be_restarted(caplog) -> None:
    """Found by a review: the weight-sync loop ran as a task nobody watched; had it failed
    (a refused report, a socket error), the server would generate on with weights no sync
    would load again, or, held for a catch-up, sit refused for good. It now stops the
    server with exit 4, which its supervisor restarts."""
    import logging

    srv, _ = _server(StandInClient(tasks=0), max_inflight=N)

    async def broken(stopping) -> None:
        raise RuntimeError("the coordinator refused the sync report")

    srv.syncs.loop = broken  # type: ignore[method-assign]

    async def main() -> int:
        return await asyncio.wait_for(srv.run(), 10)

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(main()) == 4
    assert "its weight-sync loop failed (RuntimeError: the coordinator refused" in caplog.text


def test_a_server_refused_by_an_answering_coordinator_exits_4_not_3(caplog) -> None:
    """Exit 3 tells the launcher the coordinator was silent (a hung learner, which it
    kills); a server whose coordinator answered but refused it exits 4 (restarted alone)."""
    import logging

    client = StandInClient(tasks=0)
    srv, _ = _server(client, max_inflight=N)
    client.refused = "its registration was refused (config_mismatch)"
    client.gone.set()

    async def main() -> int:
        return await asyncio.wait_for(srv.run(), 10)

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(main()) == 4
    assert "the coordinator answered, but its registration was refused" in caplog.text
    client.refused = ""  # silent: 3, as before
    srv2, _ = _server(client, max_inflight=N)
    assert asyncio.run(asyncio.wait_for(srv2.run(), 10)) == 3


@pytest.mark.parametrize(("error", "code"), [("internal", 4), ("config_mismatch", 2)])
def test_a_task_request_the_coordinator_failed_on_restarts_the_server(error, code) -> None:
    """Found by a review: any refused task request ended the run as a config error (exit
    2, final), telling the operator to start the server with the learner's config, even
    one the coordinator failed on itself (``internal``): that one is restarted (exit 4)."""
    from asyncrl.net.transport import RequestRefused

    class Refusing(StandInClient):
        def request_tasks(self, max_tasks=None, wait_s=None, max_samples=0):
            raise RequestRefused(f"refused task_request: {error}: x", error)

    srv, _ = _server(Refusing(tasks=4), max_inflight=N)
    assert asyncio.run(asyncio.wait_for(srv.run(), 10)) == code
