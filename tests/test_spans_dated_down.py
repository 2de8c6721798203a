"""A response in flight across a catch-up *down* (a learner restarted from an older
checkpoint labels its weights below the ones the server held): its tokens' versions would
go backwards, which the wire refuses. The server dates the earlier tokens down, so the
group reaches the learner instead of failing as a task error (rollout_servers/samples.py).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from asyncrl import wire
from asyncrl.rewards.sandbox import ScoreResult
from buffer.core import ReplayBuffer
from learner.loop import to_rollouts
from rollout_servers.agent import episode_samples, episode_trajectories
from rollout_servers.episodes import Episode, Piece
from rollout_servers.groups import build_group
from rollout_servers.samples import Sample, add_span
from rollout_servers.server_stats import ServerStats

pytestmark = pytest.mark.timeout(60)

PROMPT = [1, 2, 3]


def _task(task_id: str = "train/0/0") -> SimpleNamespace:
    return SimpleNamespace(task_id=task_id, validation=False, data_source="arith", prompt=None)


@pytest.mark.parametrize(
    ("before", "version", "n", "after", "dated"),
    [
        ([], 4, 3, [(4, 3)], False),
        ([], 4, 0, [], False),  # nothing sampled: no run
        ([(4, 3)], 4, 2, [(4, 5)], False),  # same version: one run
        ([(4, 3)], 5, 2, [(4, 3), (5, 2)], False),  # a push mid-response
        ([(4, 3), (5, 2)], 5, 0, [(4, 3), (5, 2)], False),
        ([(12, 3)], 10, 2, [(10, 5)], True),  # the catch-up down
        ([(11, 1), (12, 3)], 10, 2, [(10, 6)], True),
        ([(11, 1), (12, 3)], 11, 2, [(11, 6)], True),  # down to an earlier run's version
        ([(12, 3)], 10, 0, [(10, 3)], True),  # no new token: still dated (next ones are 10)
        ([(9, 2), (11, 3)], 10, 1, [(9, 2), (10, 4)], True),  # older runs keep their date
        ([(9, 2), (10, 1), (11, 3)], 10, 1, [(9, 2), (10, 5)], True),
    ],
)
def test_add_span_keeps_versions_from_going_backwards(before, version, n, after, dated):
    spans = list(before)
    assert add_span(spans, version, n) is dated
    assert spans == after


def test_a_response_across_a_catch_up_down_reaches_the_learner_dated_down():
    """As the engine extends a sample piece by piece: 3 tokens under v12, then 2 under the
    restarted learner's v10 (vLLM labels a request's tokens with each weight version)."""
    a = Sample(start_version=12)
    a.extend([5, 6, 7], [-0.5, -0.25, -1.0], [(12, 3)])
    a.extend([8, 9], [-0.75, -0.125], [(10, 2)])
    assert a.version_spans == [(10, 5)] and a.dated_down
    b = Sample(start_version=10)
    b.extend([5, 6], [-0.5, -0.5], [(10, 2)])
    assert not b.dated_down
    scores = [ScoreResult(score=1.0), ScoreResult(score=0.0)]
    group = build_group(_task(), PROMPT, [a, b], scores, server_id="s", created_at=0.0)

    frames = [bytes(f) for f in wire.encode_trajectories(group)]
    buf = ReplayBuffer(batch_size=1, capacity_groups=4, max_policy_lag=1)
    assert buf.add_packed(wire.decode_packed(frames), now=0.0)[-1] == "completed"
    batch = buf.release(policy_version=11)  # lag 1 from v10: trained
    assert batch is not None
    reply = wire.decode_reply([bytes(f) for f in wire.encode_batch(batch)])
    assert isinstance(reply, wire.Batch)
    first = to_rollouts(reply)[0]
    assert list(first.behaviour_logprobs) == [-0.5, -0.25, -1.0, -0.75, -0.125]
    assert first.oldest_version == 10

    stats = ServerStats(SimpleNamespace(decode=lambda ids, **kw: ""))  # type: ignore[arg-type]
    stats.count_group([a, b], scores, _task())  # type: ignore[arg-type]
    assert stats.metrics["rollout/samples_dated_down"] == 1


def test_an_episode_whose_later_turn_ran_after_a_catch_up_down_is_dated_down():
    """A multi-turn episode: turn 1 under v12, a tool answer, turn 2 under v10. The piece's
    runs stay in order, the trajectory encodes, and the server counts the episode once."""
    turn1 = Sample(token_ids=[5, 6], logprobs=[-0.5, -0.5], version_spans=[(12, 2)])
    turn2 = Sample(token_ids=[8], logprobs=[-0.25], version_spans=[(10, 1)])
    piece = Piece(prompt_ids=list(PROMPT), start_version=12)
    piece.add_sampled(turn1)
    piece.add_inserted([40, 41])  # the tool's answer, dated as turn 1's last token
    piece.add_sampled(turn2)
    assert piece.version_spans == [(10, 5)] and piece.dated_down
    assert piece.masked_spans == [(2, 2)]
    ep = Episode(pieces=[piece], messages=[])
    trajs = episode_trajectories(
        _task(), [ep], [ScoreResult(score=1.0)], server_id="s", created_at=0.0
    )
    [t] = wire.decode_trajectories([bytes(f) for f in wire.encode_trajectories(trajs)])
    assert [tuple(s) for s in t.meta.version_spans] == [(10, 5)]
    [whole] = episode_samples([ep])
    assert whole.dated_down


def test_an_episode_split_across_a_catch_up_down_counts_once_in_order():
    """Pieces of one split episode are trajectories of their own, each in order and each
    keeping its versions on the wire; the server counts the episode as dated down once and
    its tokens under the versions they went out with."""
    a = Piece(prompt_ids=list(PROMPT), start_version=12)
    a.add_sampled(Sample(token_ids=[5, 6], logprobs=[-1.0] * 2, version_spans=[(12, 2)]))
    b = Piece(prompt_ids=[*PROMPT, 5, 6, 40], start_version=10, lead=1)
    b.add_sampled(Sample(token_ids=[7], logprobs=[-1.0], version_spans=[(10, 1)]))
    assert not a.dated_down and not b.dated_down
    [whole] = episode_samples([Episode(pieces=[a, b], messages=[])])
    assert whole.version_spans == [(12, 2), (10, 1)] and whole.dated_down


class _SyncingLLM:
    """Just enough of vLLM's engine for RolloutEngine.sync_weights: each load waits for
    :attr:`gate`."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        pass

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[dict]:
        await self.gate.wait()
        return [{}]

    async def reset_prefix_cache(self) -> None:
        pass

    async def update_weight_version(self, version: str) -> None:
        pass

    async def resume_generation(self) -> None:
        pass


def test_after_a_catch_up_down_a_task_waits_for_the_version_it_was_dealt():
    """The engine synced v12 (the old learner), then caught up down to v10 (the restored
    one), whose push of v11 is on its way: a task dealt for v11 at the send waits for its
    load. The highest version synced before ended such waits at once."""
    from asyncrl.sync.plan import TensorSpec, plan_buckets
    from rollout_servers.engine import RolloutEngine

    plan = plan_buckets([TensorSpec("w", (2, 3), "float32")], bucket_bytes=1 << 20)

    async def scenario() -> tuple[float, int]:
        llm = _SyncingLLM()
        engine = RolloutEngine(llm, version=11)  # type: ignore[arg-type]
        await engine.sync_weights(12, plan, timeout_s=5)
        await engine.sync_weights(10, plan, timeout_s=5)
        llm.gate.clear()
        push = asyncio.create_task(engine.sync_weights(11, plan, timeout_s=5))
        await asyncio.sleep(0.05)
        asyncio.get_running_loop().call_later(0.3, llm.gate.set)
        waited = await engine.reach(11, 5.0)
        llm.gate.set()
        await push
        return waited, engine.version

    waited, version = asyncio.run(scenario())
    assert version == 11 and waited >= 0.2
