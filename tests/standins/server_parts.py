"""In-process stand-ins for a rollout server's collaborators (no vLLM, no sockets): an
engine that answers every request with :data:`RESPONSE` once its gate opens, a scorer, a
pusher that keeps what it is given, a control client that grants tasks from a counter,
and, for episodes with tools, an engine whose every turn calls a slow tool (:data:`NAP_S`
seconds) with the ``nap_tools`` fixture that serves it. The tokenizer is
:class:`tests.standins.chat.CharTokenizer`. They satisfy the protocols in
:mod:`rollout_servers.protocols`; ``tests/test_rollout_loop.py`` checks that with a type
checker and at run time."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from asyncrl.config import load_config
from asyncrl.control.messages import Registered, SyncStart, Task, TaskAckReply, TaskGrant
from asyncrl.rewards import ScoreJob, ScoreResult
from asyncrl.sync.plan import WeightPlan
from asyncrl.tools import ToolPool
from asyncrl.wire import Trajectory
from rollout_servers.agent import AgentRunner, AgentSettings
from rollout_servers.engine import SyncJoin
from rollout_servers.groups import SamplingSettings
from rollout_servers.samples import Sample
from tests.standins.chat import EOT, CharTokenizer

if TYPE_CHECKING:
    from vllm import SamplingParams

    from rollout_servers.server import RolloutServer

N = 2  # responses per task
RESPONSE = [7, 8, 9]


class StandInEngine:
    """Answers every request with :data:`RESPONSE` once :attr:`gate` opens."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {"rollout/sync_pause_s": 0.0, "rollout/resubmitted": 0}
        self.gate = asyncio.Event()
        self.requests = 0
        self.version = 0
        self.partial = False
        self.stuck = ""

    @property
    def errored(self) -> bool:
        return False

    def paused_s(self) -> float:
        return self.metrics["rollout/sync_pause_s"]  # its syncs pause for no time

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
        self.on_registered: Callable[[Registered], None] = lambda reply: None
        self.tasks_per_request = 4
        self.shutdown = threading.Event()
        self.gone = threading.Event()
        self.refused = ""
        self.left = tasks
        self.requests: list[float] = []  # when each task request was made
        self.max_samples: list[int] = []  # the free slots each request said
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
        self.on_registered(self.registered)  # as the real client, after each answer
        return self.registered

    def start_watching(self) -> object:
        return None

    def request_tasks(
        self, max_tasks: int | None = None, wait_s: float | None = None, max_samples: int = 0
    ) -> TaskGrant:
        self.requests.append(time.monotonic())
        self.max_samples.append(max_samples)
        take = min(max_tasks or self.tasks_per_request, self.left)
        if not take:
            time.sleep(0.05)
        self.left -= take
        first = len(self.acked) + self.left
        tasks = [make_task(f"train/0/{first + i}") for i in range(take)]
        return TaskGrant(tasks=tasks, policy_version=0)

    def request_slot(self) -> TaskGrant:  # no endpoint in these tests
        return TaskGrant(tasks=[], policy_version=0, reason="budget")

    def give_back_unanswered_slots(self, older_than_s: float) -> int:
        return 0

    def ack(
        self,
        task_ids: list[str],
        attempts: int = 3,
        filtered: bool = False,
        prompt_too_long: bool = False,
        dealt: list[int] | None = None,
        session: str = "",
    ) -> object:
        assert not filtered, "no task is dealt with the filter here"
        self.acked += task_ids
        return TaskAckReply(acked=list(task_ids), unknown=[])  # as the coordinator answers

    def nack(
        self, task_ids: list[str], reason: str, dealt: list[int] | None = None, session: str = ""
    ) -> object:
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


#: The coordinator session the stand-in client's tasks were dealt under (Task.dealt_session).
SESSION = "c0ffee"


def make_task(task_id: str) -> Task:
    return Task(
        task_id=task_id,
        data_source="arithmetic",
        prompt=[{"role": "user", "content": "1+1="}],
        ground_truth="2",
        n=N,
        prompt_token_ids=[1, 2, 3],
        dealt_session=SESSION,
    )


def stand_in_server(
    client: StandInClient, engine: Any, pool: Any, pusher: Any = None
) -> RolloutServer:
    """A rollout server of ``N`` responses a task and room for four tasks, on ``engine``,
    the scorer ``pool`` and ``pusher`` (default: :class:`StandInPusher`)."""
    from rollout_servers.server import RolloutServer

    cfg = load_config(None, [f"rollout.n={N}", f"rollout.max_inflight={4 * N}"])
    return RolloutServer(cfg, "s", engine, CharTokenizer(), pool, pusher or StandInPusher(), client)


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


class SyncingClient(StandInClient):
    """Deals ``tool_agent`` tasks; delivers one sync start when :attr:`sync` is set."""

    def __init__(self, tasks: int) -> None:
        super().__init__(tasks)
        self.sync = threading.Event()
        self.sync_reported = threading.Event()
        self.polls_ended: list[float] = []  # when each next_sync call returned

    def request_tasks(
        self, max_tasks: int | None = None, wait_s: float | None = None, max_samples: int = 0
    ) -> TaskGrant:
        grant = super().request_tasks(max_tasks, wait_s, max_samples)
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


def agent_runner(
    engine: ToolCallingEngine, tools: ToolPool, timeout_s: float = 60.0
) -> AgentRunner:
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
