"""The rollout server's loop with stand-ins for its collaborators (no vLLM, no sockets): it
sleeps while its slots are full instead of polling, takes the next tasks as soon as a group
finishes, stops at once when told, and keeps bounded windows of recent rewards and lengths.
The stand-ins satisfy the protocols in :mod:`rollout_servers.protocols`, which a type
checker holds them to (see the typed assignments in :func:`_server`)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from asyncrl.config import load_config
from asyncrl.control.messages import Registered, SyncStart, Task, TaskGrant
from asyncrl.rewards import ScoreJob, ScoreResult
from asyncrl.sync.weights import WeightPlan
from asyncrl.tools import ToolPool
from asyncrl.wire import Trajectory
from rollout_servers import agent as agent_module
from rollout_servers import protocols, server
from rollout_servers.agent import AgentRunner, AgentSettings
from rollout_servers.engine import Sample, SyncJoin
from rollout_servers.groups import SamplingSettings
from rollout_servers.server import RolloutServer
from rollout_servers.server_stats import RECENT
from tests.helpers import wait_until_async
from tests.standins.chat import EOT, CharTokenizer

if TYPE_CHECKING:
    from vllm import SamplingParams

N = 2  # responses per task
RESPONSE = [7, 8, 9]


class StandInEngine:
    """Answers every request with :data:`RESPONSE` once :attr:`gate` opens."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {"rollout/sync_pause_s": 0.0, "rollout/resubmitted": 0}
        self.gate = asyncio.Event()
        self.requests = 0
        self.version = 0

    @property
    def errored(self) -> bool:
        return False

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> Sample:
        self.requests += 1
        await self.gate.wait()
        return Sample(list(RESPONSE), [-0.5] * len(RESPONSE), [(0, len(RESPONSE))], "stop")

    async def sync_weights(
        self,
        version: int,
        plan: WeightPlan,
        *,
        join: SyncJoin | None = None,
        timeout_s: float = 120.0,
    ) -> dict[str, float]:
        return {"seconds": 0.0}

    async def score(self, sequences: list[list[int]]) -> list[float]:
        return [-1.0] * sum(len(ids) - 1 for ids in sequences)

    async def reach(self, version: int, timeout_s: float) -> float:
        return 0.0  # no weights to wait for: every version counts as loaded


class StandInTokenizer:
    """Token ids as space-separated numbers."""

    def apply_chat_template(
        self,
        conversation: Any,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> Any:
        return " ".join(m["content"] for m in conversation)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> Any:
        return " ".join(map(str, token_ids))


class StandInScorer:
    def score_many(self, items: Sequence[ScoreJob]) -> list[ScoreResult]:
        return [ScoreResult(1.0) for _ in items]


class StandInPusher:
    def __init__(self) -> None:
        self.groups: list[Sequence[Trajectory]] = []

    async def send_async(
        self, trajectories: Sequence[Trajectory], timeout_s: float | None = None
    ) -> float:
        self.groups.append(trajectories)
        return 0.0


class StandInClient:
    """Grants tasks from a counter; with none to give, holds the request briefly, as the
    coordinator's long-poll does."""

    def __init__(self, tasks: int) -> None:
        self.registered: Registered | None = None
        self.metrics: dict[str, float] = {}
        self.held_tasks: Callable[[], list[str]] = list
        self.tasks_per_request = 4
        self.shutdown = threading.Event()
        self.gone = threading.Event()
        self.left = tasks
        self.requests: list[float] = []  # when each task request was made
        self.acked: list[str] = []

    def register(self) -> Registered:
        self.registered = Registered(
            server_id="s",
            session="1",
            policy_version=0,
            sync_store_host="127.0.0.1",
            sync_store_port=1,
            generation="",
            heartbeat_s=0.2,
            dead_after_s=2.0,
            catchup=False,
        )
        return self.registered

    def start_watching(self) -> object:
        return None

    def request_tasks(self, max_tasks: int | None = None) -> TaskGrant:
        self.requests.append(time.monotonic())
        take = min(max_tasks or self.tasks_per_request, self.left)
        if not take:
            time.sleep(0.05)
        self.left -= take
        first = len(self.acked) + self.left
        tasks = [_task(f"train/0/{first + i}") for i in range(take)]
        return TaskGrant(tasks=tasks, policy_version=0)

    def request_slot(self) -> TaskGrant:  # no endpoint in these tests
        return TaskGrant(tasks=[], policy_version=0, reason="budget")

    def ack(self, task_ids: list[str], attempts: int = 3, filtered: bool = False) -> object:
        assert not filtered, "no task is dealt with the filter here"
        self.acked += task_ids
        return None

    def nack(self, task_ids: list[str], reason: str) -> object:
        raise AssertionError(f"no task should fail here: {reason}")

    def next_sync(self, timeout_s: float = 0.0) -> SyncStart | None:
        time.sleep(timeout_s)
        return None

    def sync_done(
        self,
        start: SyncStart,
        ok: bool,
        error: str = "",
        seconds: float = 0.0,
        *,
        probe: list[float] | None = None,
    ) -> object:
        return None


def _task(task_id: str) -> Task:
    return Task(
        task_id=task_id,
        data_source="arithmetic",
        prompt=[{"role": "user", "content": "1+1="}],
        ground_truth="2",
        n=N,
        prompt_token_ids=[1, 2, 3],
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
    ] = (engine, StandInTokenizer(), StandInScorer(), StandInPusher(), client)
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
    monkeypatch.setattr(server, "sampling_params", lambda settings, task, index: None)


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
        srv.stats.count_group([sample, sample], [score, score], _task(f"train/0/{i}"))
    assert len(srv.stats.rewards) == len(srv.stats.lengths) == RECENT
    assert srv.snapshot()["rollout/reward_mean"] == 1.0  # only the latest RECENT responses
    assert srv.snapshot()["rollout/response_length_mean"] == len(RESPONSE)


# ------------------------------------------------------------------ tools and control calls
NAP_S = 0.5  # how long the slow tool takes
NAP_TOOL = """
import time

from asyncrl.tools import BaseTool


class NapTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(NAP_S)
        return "rested", 0.0, {}
""".replace("NAP_S", str(NAP_S))
CALL = '<tool_call>\n{"name": "nap", "arguments": {}}\n</tool_call>' + EOT


@pytest.fixture
def nap_tools(tmp_path: Path) -> Iterator[ToolPool]:
    """Two tool workers whose only tool takes :data:`NAP_S` seconds."""
    (tmp_path / "nap.py").write_text(NAP_TOOL)
    schema = {"type": "function", "function": {"name": "nap", "parameters": {}}}
    tool = {"class_name": "nap.py:NapTool", "config": {}, "tool_schema": schema}
    (tmp_path / "tools.yaml").write_text(json.dumps({"tools": [tool]}))
    with ToolPool(tmp_path / "tools.yaml", num_workers=2, timeout_s=10.0) as pool:
        yield pool


class ToolCallingEngine(StandInEngine):
    """Every turn calls the slow tool; records when a weight sync reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate.set()
        self.synced_at = 0.0

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> Sample:
        self.requests += 1
        ids = [ord(c) for c in CALL]
        return Sample(ids, [-0.5] * len(ids), [(0, len(ids))], "stop")

    async def sync_weights(
        self,
        version: int,
        plan: WeightPlan,
        *,
        join: SyncJoin | None = None,
        timeout_s: float = 120.0,
    ) -> dict[str, float]:
        self.synced_at = time.monotonic()
        return {"seconds": 0.0}

    async def score(self, sequences: list[list[int]]) -> list[float]:
        return [-1.0] * sum(len(ids) - 1 for ids in sequences)


class SyncingClient(StandInClient):
    """Deals ``tool_agent`` tasks; delivers one sync start when :attr:`sync` is set."""

    def __init__(self, tasks: int) -> None:
        super().__init__(tasks)
        self.sync = threading.Event()
        self.sync_reported = threading.Event()
        self.polls_ended: list[float] = []  # when each next_sync call returned

    def request_tasks(self, max_tasks: int | None = None) -> TaskGrant:
        grant = super().request_tasks(max_tasks)
        tasks = [msgspec.structs.replace(t, agent_name="tool_agent") for t in grant.tasks]
        return TaskGrant(tasks=tasks, policy_version=0)

    def next_sync(self, timeout_s: float = 0.0) -> SyncStart | None:
        synced = self.sync.wait(timeout_s)
        self.polls_ended.append(time.monotonic())
        if not synced or self.sync_reported.is_set():
            return None
        return SyncStart(
            sync_id=1, version=1, generation="g1", rank=1, world_size=2, plan=WeightPlan()
        )

    def sync_done(
        self,
        start: SyncStart,
        ok: bool,
        error: str = "",
        seconds: float = 0.0,
        *,
        probe: list[float] | None = None,
    ) -> object:
        self.sync_reported.set()
        return None


def _agent(engine: ToolCallingEngine, tools: ToolPool, timeout_s: float = 60.0) -> AgentRunner:
    cfg = load_config(None, [f"rollout.n={N}"])
    settings = AgentSettings(
        max_assistant_turns=2,  # one tool turn per episode
        max_user_turns=None,
        max_parallel_calls=1,
        max_prompt_len=512,
        max_response_len=512,
        episode_timeout_s=timeout_s,
    )
    return AgentRunner(settings, SamplingSettings.from_config(cfg), engine, CharTokenizer(), tools)


def test_a_weight_sync_is_not_delayed_by_queued_tool_calls(monkeypatch, nap_tools) -> None:
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
            agent=_agent(engine, nap_tools),
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


def test_waiting_for_a_tool_worker_ends_at_the_episode_deadline(monkeypatch, nap_tools) -> None:
    """16 episodes of one tool call each on 2 workers would take 4 s; with a 1 s deadline
    the episodes still queued end at their deadline (``timeout``), not after the queue."""
    monkeypatch.setattr(agent_module, "turn_params", lambda *args: None)
    runner = _agent(ToolCallingEngine(), nap_tools, timeout_s=1.0)
    task = msgspec.structs.replace(_task("calc-0"), n=16, agent_name="tool_agent")

    async def scenario() -> float:
        start = time.monotonic()
        await asyncio.gather(*[runner.episode(task, i) for i in range(task.n)])
        return time.monotonic() - start

    took = asyncio.run(scenario())
    assert took < 1.0 + 2 * NAP_S, f"{took:.1f} s"
    assert runner.metrics["rollout/agent/episodes_ended/timeout"] >= 8
