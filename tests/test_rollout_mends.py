"""Mends of the rollout server found by a review, each with the fault that showed it:

- a reward worker that cannot be replaced breaks the pool for good: the server exits 4 (to
  be restarted with fresh workers) instead of generating and failing every group forever;
- at shutdown the Leave is sent even while pushes blocked by a buffer that does not read
  hold asyncio's default executor;
- a group whose one sample (or episode) fails cancels the others, not only reports failure;
- an episode whose first turn times out is dated to the engine's version, not version 0;
- timeouts of ``asyncio.wait_for`` are caught as Python 3.10 raises them.

Real reward and tool worker processes, a real pusher on a socket nobody reads; the engine,
the tokenizer and the coordinator client are the stand-ins of
:mod:`tests.standins.server_parts`."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from asyncrl import wire
from asyncrl.config import load_config
from asyncrl.net.transport import TrajectoryPusher
from asyncrl.rewards import RewardPool, ScoreResult
from asyncrl.sandbox.workers import PoolBroken
from asyncrl.tools import ToolPool
from rollout_servers import agent as agent_module
from rollout_servers import main as rollout_main
from rollout_servers import task_groups
from rollout_servers.agent import AgentRunner, AgentSettings, episode_trajectories
from rollout_servers.engine import RolloutEngine
from rollout_servers.groups import SamplingSettings
from rollout_servers.lanes import Lanes
from rollout_servers.samples import Sample
from rollout_servers.server_stats import ServerStats
from tests.helpers import wait_until_async
from tests.standins.chat import CharTokenizer
from tests.standins.server_parts import (  # noqa: F401 (nap_tools: a fixture)
    NAP_S,
    SESSION,
    N,
    StandInClient,
    StandInEngine,
    StandInPusher,
    StandInScorer,
    ToolCallingEngine,
    agent_runner,
    make_task,
    nap_tools,
    stand_in_server,
)
from tests.standins.trajgen import make_traj


@pytest.fixture(autouse=True)
def _no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling parameters are the engine's business; importing vLLM for them takes seconds."""
    monkeypatch.setattr(task_groups, "sampling_params", lambda settings, task, index: None)
    monkeypatch.setattr(agent_module, "turn_params", lambda *args: None)


class FailingClient(StandInClient):
    """Records failure reports (the stand-in's own refuses them) and leaves."""

    def __init__(self, tasks: int) -> None:
        super().__init__(tasks)
        self.nacked: list[str] = []
        self.sessions: set[str] = set()  # the coordinator sessions the reports named
        self.left_at = 0.0

    def nack(
        self, task_ids: list[str], reason: str, dealt: list[int] | None = None, session: str = ""
    ) -> object:
        self.nacked += task_ids
        self.sessions.add(session)
        return None

    def leave(self, reason: str = "", timeout_s: float = 2.0) -> bool:
        self.left_at = time.monotonic()
        return True

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ a broken scorer pool

#: A scorer whose first call kills its worker and whose file cannot load once it has: the
#: replacement worker fails to start, as a scorer that imports a vanished file would.
DYING_SCORER = """
import os

MARK = {mark!r}
if os.path.exists(MARK):
    raise RuntimeError("the scorer's data is gone")


def compute_score(*args, **kwargs):
    if not os.path.exists(MARK):
        open(MARK, "w").close()
        os._exit(1)
    return 1.0
"""


def _dying_scorer(tmp_path: Path) -> str:
    path = tmp_path / "dying.py"
    path.write_text(DYING_SCORER.format(mark=str(tmp_path / "died")))
    return str(path)


def test_a_pool_that_cannot_replace_a_worker_fails_every_call(tmp_path: Path) -> None:
    """Broken, the pool had one worker left and a None in its queue: about every other call
    raised, the rest passed, so no caller could tell it would never recover."""
    with RewardPool(num_workers=2, timeout_s=10, custom_path=_dying_scorer(tmp_path)) as pool:
        assert pool.score("x", "kills its worker", None).error == "worker_died"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the replacement has failed to start
            try:
                pool.score("x", "fine", None)
            except PoolBroken:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the pool never reported its lost worker")
        for _ in range(4):
            with pytest.raises(PoolBroken, match="could not replace a worker"):
                pool.score("x", "fine", None)


def test_a_replacement_too_slow_to_start_names_the_key_to_raise(tmp_path: Path) -> None:
    """A worker replaced mid-run whose scorer's import takes longer than
    ``reward.startup_timeout_s`` breaks the pool with the same line as at the pool's start,
    naming the key and the fix (the replacement's line named neither)."""
    path = tmp_path / "slow.py"
    mark = tmp_path / "died"
    path.write_text(
        DYING_SCORER.format(mark=str(mark)).replace(
            'raise RuntimeError("the scorer\'s data is gone")', "import time; time.sleep(5)"
        )
    )
    with RewardPool(
        num_workers=1, timeout_s=10, custom_path=str(path), startup_timeout_s=1.0
    ) as pool:
        assert pool.score("x", "kills its worker", None).error == "worker_died"
        with pytest.raises(PoolBroken, match="could not replace a worker") as err:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                pool.score("x", "fine", None)
                time.sleep(0.05)
    assert "raise reward.startup_timeout_s" in str(err.value), err.value


def test_a_server_whose_reward_workers_cannot_be_replaced_exits_4(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It generated each group, failed it at scoring and reported it failed, forever; now
    it stops (exit 4: the launcher restarts it with fresh workers), saying why once."""
    caplog.set_level(logging.INFO, logger="rollout_servers")

    async def scenario(pool: RewardPool) -> tuple[int, FailingClient]:
        client = FailingClient(tasks=10_000)
        engine = StandInEngine()
        engine.gate.set()
        srv = stand_in_server(client, engine, pool)
        return await asyncio.wait_for(srv.run(), 30.0), client

    pool = RewardPool(num_workers=1, timeout_s=10, custom_path=_dying_scorer(tmp_path))
    try:
        code, client = asyncio.run(scenario(pool))
    finally:
        pool.close()
    assert code == 4
    assert 1 <= len(client.nacked) <= 4 * N, client.nacked  # dealt again, and no more tasks
    assert client.sessions == {SESSION}  # each report names the coordinator that dealt it
    stops = [r.getMessage() for r in caplog.records if " stops: " in r.getMessage()]
    assert len(stops) == 1 and "RewardPool could not replace a worker" in stops[0], stops
    tracebacks = [r for r in caplog.records if r.exc_info and r.name.startswith("rollout")]
    assert not tracebacks  # the cause is one line, not a traceback per task


# ------------------------------------------------------------------ leaving while pushes block


def test_the_leave_is_sent_while_pushes_blocked_by_the_buffer_fill_the_default_executor() -> None:
    """Pushes blocked by a buffer that does not read held every thread of asyncio's default
    executor; the leave queued behind them, the pusher's close (which frees them) came after
    the leave: the server hung until killed and never said it left."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)  # the buffer: connected, never reads
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind("tcp://127.0.0.1:*")
    pusher = TrajectoryPusher(pull.getsockopt_string(zmq.LAST_ENDPOINT), hwm=1, linger_s=0)
    big = wire.encode_trajectories([make_traj("big", response_len=200_000)])
    with pytest.raises(TimeoutError):
        for _ in range(1000):  # fill every queue and kernel buffer on the way
            pusher.send_frames(big, timeout_s=0.3)

    async def scenario() -> tuple[FailingClient, float]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(2))  # a small machine's, sooner full
        client = FailingClient(tasks=4)  # 4 groups, 2 blocked in the executor, 2 queued
        engine = StandInEngine()
        engine.gate.set()
        srv = stand_in_server(client, engine, StandInScorer(), pusher)
        run = asyncio.create_task(srv.run())
        await wait_until_async(
            lambda: srv.stats.after_generation.at["pushing"] == 4 * N,
            "every group to wait for its push",
            10,
        )
        srv.stop()
        assert await asyncio.wait_for(run, 5.0) == 0
        stopped = time.monotonic()
        try:
            await asyncio.wait_for(rollout_main._leave_and_close(client, pusher), 10.0)
        finally:
            pusher.close(linger_s=0)  # without the mend: frees the executor for the exit
        return client, time.monotonic() - stopped

    try:
        client, took = asyncio.run(scenario())
    finally:
        pull.close()
        ctx.term()
    assert client.left_at, "the Leave was never sent"
    assert took < 5.0, f"leaving took {took:.1f} s"


# ------------------------------------------------------------------ sync groups by session


class OneFailsEngine(StandInEngine):
    """The first request fails at once; the others wait for :attr:`gate`, noting when one
    is cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = 0

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Sample:
        self.requests += 1
        if self.requests == 1:
            await asyncio.sleep(0.05)
            raise RuntimeError("the engine refused the request")
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return await super().generate(prompt_ids, params, request_id)


@pytest.mark.parametrize("episodes", [False, True], ids=["single_turn", "episodes"])
def test_a_failing_sample_cancels_the_rest_of_its_group(episodes: bool) -> None:
    """``asyncio.gather`` left them running: the task was reported failed and its slots
    freed while its other requests still took the engine's time."""
    n = 4

    async def scenario() -> OneFailsEngine:
        engine = OneFailsEngine()
        agent = None
        sampling = SamplingSettings.from_config(load_config(None, []))
        if episodes:
            settings = AgentSettings(None, None, 1, 512, 512, 60.0)
            agent = AgentRunner(settings, sampling, engine, CharTokenizer(), None)
        cfg = load_config(None, [f"rollout.n={n}"])
        tok = CharTokenizer()
        groups = task_groups.TaskGroups(
            cfg, "s", engine, tok, StandInScorer(), Lanes(), sampling, ServerStats(tok), agent
        )
        task = msgspec.structs.replace(
            make_task("t"), n=n, agent_name="tool_agent" if episodes else None
        )
        with pytest.raises(RuntimeError, match="refused"):  # not a hang on the siblings
            await asyncio.wait_for(groups.make(task, 0.0), 10.0)
        # Looked at before the loop ends (asyncio.run cancels what is left): each sibling
        # was cancelled, and had ended when the failure was raised.
        assert engine.cancelled == n - 1
        return engine

    assert asyncio.run(scenario()).requests == n


# ------------------------------------------------------------------ an episode's first turn


def test_an_episode_whose_first_turn_times_out_carries_the_engines_version() -> None:
    """Its empty sample was dated version 0: the group's version is its oldest sample's, so
    one such episode had the whole group dropped for lag."""

    async def scenario() -> list[tuple[int, int]]:
        engine = StandInEngine()  # its gate stays shut: the first turn never answers
        engine.version = 7
        settings = AgentSettings(None, None, 1, 512, 512, 0.2)
        sampling = SamplingSettings.from_config(load_config(None, []))
        runner = AgentRunner(settings, sampling, engine, CharTokenizer(), None)
        task = msgspec.structs.replace(make_task("t"), n=1, agent_name="tool_agent")
        ep = await runner.episode(task, 0)
        assert ep.ended == "timeout"
        (traj,) = episode_trajectories(task, [ep], [ScoreResult(0.0)], server_id="s", created_at=0)
        return traj.meta.version_spans

    assert asyncio.run(scenario()) == [(7, 0)]


# ------------------------------------------------------------------ Python 3.10 timeouts


class AsyncioTimeout(Exception):
    """What ``asyncio.wait_for`` raises on Python 3.10: ``asyncio.TimeoutError``, not a
    subclass of the builtin ``TimeoutError`` (it became that class in 3.11)."""


@pytest.fixture
def py310_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncio.wait_for`` and ``asyncio.TimeoutError`` as Python 3.10 has them."""
    real = asyncio.wait_for

    async def wait_for(aw: Any, timeout: float | None) -> Any:
        try:
            return await real(aw, timeout)
        except TimeoutError:
            raise AsyncioTimeout() from None

    monkeypatch.setattr(asyncio, "wait_for", wait_for)
    monkeypatch.setattr(asyncio, "TimeoutError", AsyncioTimeout)


def test_waiting_for_a_version_ends_at_its_bound_on_python_310(py310_timeouts: None) -> None:
    """``except TimeoutError`` missed 3.10's timeout: the task failed instead of starting
    under the weights it has."""

    async def scenario() -> float:
        return await RolloutEngine(llm=None).reach(1, 0.1)

    assert 0.05 < asyncio.run(scenario()) < 2.0


def test_a_tool_wait_past_the_deadline_ends_the_episode_on_python_310(
    py310_timeouts: None,
    nap_tools: ToolPool,  # noqa: F811
) -> None:
    """The episode's wait for a tool worker (its deadline) ended in an exception that
    failed the whole group on 3.10, instead of ending the episode as timed out."""
    runner = agent_runner(ToolCallingEngine(), nap_tools, timeout_s=NAP_S / 2)
    task = msgspec.structs.replace(make_task("t"), n=1, agent_name="tool_agent")
    ep = asyncio.run(runner.episode(task, 0))
    assert ep.ended == "timeout"


def test_every_sibling_has_ended_when_the_failure_is_raised() -> None:
    """:func:`task_groups.gather_or_cancel` on plain coroutines: results in order when
    all succeed; on a failure, no sibling is left pending."""

    async def value(x: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return x

    async def fail() -> int:
        await asyncio.sleep(0.01)
        raise ValueError("one failed")

    async def scenario() -> None:
        assert await task_groups.gather_or_cancel(value(1, 0.02), value(2, 0.0)) == [1, 2]
        before = set(asyncio.all_tasks())
        with pytest.raises(ValueError):  # at once, not after the siblings' 10 s
            await asyncio.wait_for(
                task_groups.gather_or_cancel(value(1, 10), fail(), value(3, 10)), 5.0
            )
        assert set(asyncio.all_tasks()) <= before

    asyncio.run(scenario())


def test_a_task_started_under_older_weights_than_dealt_is_counted_and_said(caplog) -> None:
    """A review: a task that gave up waiting for its dealt version (a failed or slow sync)
    left only a longer ``rollout/version_wait_s``, like a slow load."""

    async def scenario() -> float:
        client = StandInClient(tasks=0)
        client.register()
        engine = StandInEngine()
        engine.gate.set()
        srv = stand_in_server(client, engine, StandInScorer())
        task = msgspec.structs.replace(make_task("t"), dealt_version=3)
        srv.inflight += task.n
        await srv._run_task(task)
        srv.lanes.close()
        return srv.metrics["rollout/version_wait_missed"]

    with caplog.at_level(logging.WARNING):
        assert asyncio.run(scenario()) == 1
    assert "starts under version 0, not 3 it was dealt for" in caplog.text
