"""The rollout server's side of the weight syncs (:mod:`rollout_servers.server_syncs`),
mends found by reviews:

- a learner restart reuses sync ids: a sync group is known by its session and generation;
- the post-sync probe never holds the sync's report past its bound, and the engine keeps
  a sequence slot for it.

The engine and the coordinator client are the stand-ins of
:mod:`tests.standins.server_parts`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from asyncrl.config import load_config
from asyncrl.control.messages import SyncStart
from asyncrl.sync.plan import WeightPlan
from rollout_servers import main as rollout_main
from rollout_servers.engine import RolloutEngine, SyncJoin
from tests.standins.server_parts import (
    StandInClient,
    StandInEngine,
    StandInScorer,
    stand_in_server,
)


# ------------------------------------------------------------------ joining a sync group
class JoinRecordingEngine(StandInEngine):
    def __init__(self) -> None:
        super().__init__()
        self.joins: list[SyncJoin | None] = []

    async def sync_weights(
        self,
        version: int,
        plan: WeightPlan,
        *,
        join: SyncJoin | None = None,
        timeout_s: float = 120.0,
    ) -> dict[str, float]:
        self.joins.append(join)
        return {"seconds": 0.0}


def test_a_restarted_learners_group_of_the_same_generation_is_joined() -> None:
    """A learner restarted from a checkpoint numbers its syncs from the checkpoint's ids:
    its ``main/<id>`` can be the one this engine is in with the dead learner. Taken for the
    same group, the server received on a group nobody sends on."""

    def start(session: str, sync_id: int) -> SyncStart:
        return SyncStart(
            sync_id=sync_id,
            version=sync_id,
            generation="main/1",
            rank=1,
            world_size=2,
            plan=WeightPlan(),
            session=session,
        )

    async def scenario() -> list[SyncJoin | None]:
        client = StandInClient(tasks=0)
        client.register()
        engine = JoinRecordingEngine()
        srv = stand_in_server(client, engine, StandInScorer())
        assert client.registered is not None
        client.registered = msgspec.structs.replace(client.registered, session="first")
        await srv.syncs.sync(start("first", 1))
        await srv.syncs.sync(start("first", 2))  # the same group again: no new join
        client.registered = msgspec.structs.replace(client.registered, session="second")
        await srv.syncs.sync(start("second", 1))  # the restarted learner's
        srv.lanes.close()
        return engine.joins

    joins = asyncio.run(scenario())
    assert [j is not None for j in joins] == [True, False, True]


def test_a_sync_start_of_an_earlier_session_is_skipped() -> None:
    """Found by a review: a sync start queued before the server registered again (with a
    restarted learner) was joined under the new registration's store and secret: an empty
    meeting held the server ``sync.timeout_s`` (its real catch-up queued behind it), or,
    the sync id reused, it joined another round's meeting as a rank it is not."""

    async def scenario() -> tuple[list[SyncJoin | None], list]:
        client = ProbeReportClient()
        client.register()
        engine = JoinRecordingEngine()
        srv = stand_in_server(client, engine, StandInScorer())
        assert client.registered is not None
        old = SyncStart(
            sync_id=3, version=3, generation="main/3", rank=1, world_size=2,
            plan=WeightPlan(), session="earlier",
        )  # fmt: skip
        await srv.syncs.sync(old)
        await srv.syncs.sync(msgspec.structs.replace(old, session=client.registered.session))
        srv.lanes.close()
        return engine.joins, client.reports

    joins, reports = asyncio.run(scenario())
    assert len(joins) == 1 and joins[0] is not None  # only the current session's start
    assert len(reports) == 1


# ------------------------------------------------------------------ a failing sample


# ------------------------------------------------------------------ the post-sync probe


class SlowProbeEngine(StandInEngine):
    """An engine whose probe queues behind requests that do not finish soon."""

    async def score(self, sequences: list[list[int]]) -> list[float]:
        await asyncio.sleep(60)
        return []


class ProbeReportClient(StandInClient):
    def __init__(self) -> None:
        super().__init__(tasks=0)
        self.reports: list[tuple[bool, list[float] | None]] = []

    def sync_done(self, start, ok, error="", seconds=0.0, *, probe=None) -> object:
        self.reports.append((ok, probe))
        return None


def test_a_probe_that_cannot_be_scored_soon_does_not_hold_the_sync_report(monkeypatch) -> None:
    """A review: the probe is an ordinary request, and with every engine slot taken it
    waited for a running request to finish (0.66 s against 0.01 s idle on the tiny model;
    minutes with long responses), and the sync's report, and the learner's next push, with
    it; past ``sync.timeout_s`` a server that loaded its weights was dropped. The wait is
    bounded: the sync is reported without the probe, and counted."""
    from rollout_servers import server_syncs

    monkeypatch.setattr(server_syncs, "PROBE_S", 0.2)

    async def scenario() -> tuple[list, float, float]:
        client = ProbeReportClient()
        client.register()
        srv = stand_in_server(client, SlowProbeEngine(), StandInScorer())
        start = SyncStart(
            sync_id=1, version=1, generation="main/1", rank=1, world_size=2, plan=WeightPlan()
        )
        began = time.monotonic()
        await srv.syncs.sync(start)
        took = time.monotonic() - began
        srv.lanes.close()
        return client.reports, took, srv.metrics["rollout/probe_timeouts"]

    reports, took, timeouts = asyncio.run(scenario())
    assert reports == [(True, [])] and took < 5.0 and timeouts == 1


class BrokenWeightsEngine(StandInEngine):
    """An engine whose loaded weights score the probe NaN (and one token -inf)."""

    async def score(self, sequences: list[list[int]]) -> list[float]:
        return [float("nan"), float("-inf"), -1.0]


def test_a_probe_scored_nan_by_broken_weights_is_reported_and_named(caplog) -> None:
    """A server whose weights score the probe NaN or inf reported no probe at all, so the
    worst case the probe is for passed unseen (``sync/probe_servers`` left it out). It is
    reported as scored, with a warning, and the learner's comparison names the server."""
    from asyncrl.sync.probe import compare, probe_metrics

    async def scenario() -> list:
        client = ProbeReportClient()
        client.register()
        srv = stand_in_server(client, BrokenWeightsEngine(), StandInScorer())
        start = SyncStart(
            sync_id=1, version=1, generation="main/1", rank=1, world_size=2, plan=WeightPlan()
        )
        await srv.syncs.sync(start)
        srv.lanes.close()
        return client.reports

    with caplog.at_level("WARNING", logger="rollout_servers.server_syncs"):
        ((ok, probe),) = asyncio.run(scenario())
    assert ok and probe is not None and len(probe) == 3 and probe[2] == -1.0
    assert any("scored NaN or inf" in r.getMessage() for r in caplog.records)
    mine = [-1.0, -2.0, -1.0]
    assert compare(mine, {"s0": mine, "broken": probe}) == {"s0": 0.0, "broken": float("inf")}
    metrics = probe_metrics(mine, {"s0": mine, "broken": probe})
    assert metrics["sync/probe_servers"] == 2 and metrics["sync/probe_broken_servers"] == 1
    assert metrics["sync/probe_mean_abs_diff"] == float("inf")
    assert metrics["sync/probe_max_abs_diff"] == metrics["sync/probe_kl"] == float("inf")


def test_the_engine_keeps_a_slot_for_the_probe(monkeypatch, tmp_path: Path) -> None:
    """The server keeps ``rollout.max_inflight`` responses in flight: vLLM gets one more
    sequence slot, the probe's, so it never queues behind them."""
    from rollout_servers import vllm_check

    seen = {}

    async def start(cls, args, **kwargs):
        seen["max_num_seqs"] = args.max_num_seqs
        raise RuntimeError("stop here")

    monkeypatch.setattr(vllm_check, "require", lambda inline: None)
    monkeypatch.setattr(RolloutEngine, "start", classmethod(start))
    cfg = load_config(None, [f"model.path={tmp_path}", "rollout.max_inflight=12"])
    with pytest.raises(RuntimeError, match="stop here"):
        asyncio.run(rollout_main._start_engine(cfg, "rollout-0"))
    assert seen == {"max_num_seqs": 13}
    # A validation group of 8 where the server asks for groups of 2 may be dealt into the
    # last 2 free slots (alone): 6 responses over rollout.max_inflight, and the probe's.
    bigger = ["rollout.n=2", "rollout.val_kwargs.n=8"]
    cfg = load_config(None, [f"model.path={tmp_path}", "rollout.max_inflight=12", *bigger])
    with pytest.raises(RuntimeError, match="stop here"):
        asyncio.run(rollout_main._start_engine(cfg, "rollout-0"))
    assert seen == {"max_num_seqs": 19}
