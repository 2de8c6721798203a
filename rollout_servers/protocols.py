"""What the rollout server needs from the collaborators it is handed.

:class:`~rollout_servers.server.RolloutServer` is given an engine, a tokenizer, a reward
scorer, a trajectory pusher and a coordinator client. Each protocol below lists exactly
what the server calls on that collaborator, so a reader sees the seam without opening the
implementation, and a test can hand the server stand-ins (no vLLM, no sockets) that a type
checker holds to the same contract. The production implementations:

- :class:`GenerationEngine`: :class:`rollout_servers.engine.RolloutEngine` (vLLM);
- :class:`Tokenizer`: a Hugging Face tokenizer;
- :class:`Scorer`: :class:`asyncrl.rewards.RewardPool`;
- :class:`GroupPusher`: :class:`asyncrl.net.transport.TrajectoryPusher`;
- :class:`ControlClient`: :class:`asyncrl.control.client.CoordinatorClient`.

Importing this module loads no vLLM, torch or transformers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from asyncrl.control.messages import Registered, SyncStart, TaskGrant
from asyncrl.rewards import ScoreJob, ScoreResult
from asyncrl.sync.plan import WeightPlan
from asyncrl.wire import Trajectory
from rollout_servers.engine import SyncJoin
from rollout_servers.samples import Sample

if TYPE_CHECKING:
    from vllm import SamplingParams


@runtime_checkable
class GenerationEngine(Protocol):
    """Generates responses and loads pushed weights, on the server's event loop."""

    #: Cumulative engine metrics (``rollout/sync_pause_s``, ``rollout/resubmitted``).
    metrics: dict[str, float]
    #: The policy version of the weights loaded now.
    version: int
    #: A sync broke off mid-load: generation is held until a whole load (a catch-up).
    partial: bool
    #: Why a worker counts as stuck in a sync call ("" while none is): the engine is dead.
    stuck: str

    @property
    def errored(self) -> bool:
        """Whether the engine has died, or a worker is stuck in a call (then the server exits
        to be restarted)."""
        ...

    def paused_s(self) -> float:
        """Seconds generation has been paused for weight syncs so far, the pause in
        progress included."""
        ...

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> Sample:
        """One sampled response, with the policy version of each token."""
        ...

    async def sync_weights(
        self,
        version: int,
        plan: WeightPlan,
        *,
        join: SyncJoin | None = None,
        timeout_s: float = 120.0,
    ) -> dict[str, float]:
        """Receive the learner's broadcast of ``version``; returns at least ``seconds``."""
        ...

    async def score(self, sequences: list[list[int]]) -> list[float]:
        """Teacher-forced logprobs of each sequence's tokens after its first, under the
        loaded weights at temperature 1, concatenated (the post-sync probe)."""
        ...

    async def reach(self, version: int, timeout_s: float) -> float:
        """Wait (at most ``timeout_s``) until ``version`` is loaded or a sync ends without
        it; the seconds waited."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """Chat formatting of prompts without token ids, and decoding of responses for scoring.
    ``eos_token_id`` (optional) ends an assistant turn."""

    def apply_chat_template(
        self,
        conversation: Any,
        *,
        tools: Any = ...,
        add_generation_prompt: bool = ...,
        tokenize: bool = ...,
    ) -> Any:
        """The chat-formatted prompt (a string when ``tokenize=False``); ``tools``: the
        tool schemas the template names (multi-turn episodes)."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...) -> Any:
        """The text of ``token_ids`` (a string; Hugging Face types it ``str | list[str]``,
        the list being for batches)."""
        ...


@runtime_checkable
class Scorer(Protocol):
    """Scores a group's responses; never raises for a bad scorer (it scores 0.0)."""

    def score_many(self, items: Sequence[ScoreJob]) -> list[ScoreResult]:
        """One result per job, in order (blocking: the server calls it in a thread)."""
        ...


@runtime_checkable
class GroupPusher(Protocol):
    """Streams complete groups to the buffer."""

    async def send_async(
        self, trajectories: Sequence[Trajectory], timeout_s: float | None = None
    ) -> float:
        """Push one group without blocking the event loop; returns the seconds blocked."""
        ...


@runtime_checkable
class ControlClient(Protocol):
    """The server's side of the coordinator: registration, tasks, acknowledgements, syncs.
    Its heartbeat thread sets :attr:`shutdown` or :attr:`gone` and queues sync starts."""

    registered: Registered | None
    metrics: dict[str, float]  # sent with every heartbeat
    held_tasks: Callable[[], list[str]]  # said at (re-)registration
    on_registered: Callable[[Any], None]  # called after each answered registration
    tasks_per_request: int
    shutdown: threading.Event
    gone: threading.Event
    refused: str  # why, when gone although the coordinator answered ("": it was silent)

    def register(self) -> Registered:
        """Register, waiting for the coordinator; raises ``CoordinatorGone`` if it stays away."""
        ...

    def start_watching(self) -> object:
        """Start heartbeating in a thread."""
        ...

    def request_tasks(
        self, max_tasks: int | None = None, wait_s: float | None = None, max_samples: int = 0
    ) -> TaskGrant:
        """Up to ``max_tasks`` tasks of at most ``max_samples`` responses past the first (0:
        any), long-polled while none can be granted."""
        ...

    def request_slot(self) -> TaskGrant:
        """One external training slot (the OpenAI endpoint's groups), answered at once."""
        ...

    def give_back_unanswered_slots(self, older_than_s: float) -> int:
        """Give back the slots of slot requests never answered nor repeated for
        ``older_than_s``; returns how many."""
        ...

    def ack(
        self,
        task_ids: list[str],
        attempts: int = 3,
        filtered: bool = False,
        prompt_too_long: bool = False,
        dealt: list[int] | None = None,
        session: str = "",
    ) -> object:
        """Report tasks whose groups were pushed whole (``filtered``: dropped here by the
        group filter; ``dealt``: each one's attempt as this server got it, ``session`` the
        coordinator session that dealt them, ``Task.dealt_session``)."""
        ...

    def nack(
        self, task_ids: list[str], reason: str, dealt: list[int] | None = None, session: str = ""
    ) -> object:
        """Report tasks that failed before their group was pushed (dealt again); ``dealt``
        and ``session`` as for :meth:`ack`."""
        ...

    def next_sync(self, timeout_s: float = 0.0) -> SyncStart | None:
        """The next sync start to join, waiting up to ``timeout_s`` for one."""
        ...

    def sync_done(
        self,
        start: SyncStart,
        ok: bool,
        error: str = "",
        seconds: float = 0.0,
        *,
        probe: list[float] | None = None,
    ) -> object:
        """Report the outcome of a sync (and the post-sync probe under its weights)."""
        ...
