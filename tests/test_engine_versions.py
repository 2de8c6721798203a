"""A task dealt while its server loads new weights waits for them
(:meth:`rollout_servers.engine.RolloutEngine.reach`): the coordinator opens the admission
window when the learner's broadcast ends, before the servers have loaded what it sent.

The engine here wraps a stand-in for vLLM's ``AsyncLLM`` whose weight receive waits on a
gate, so the test decides when a sync ends and whether it fails. The real engine's syncs
are tested in ``tests/test_rollout_engine.py``."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.sync.plan import TensorSpec, plan_buckets
from rollout_servers.engine import RolloutEngine
from rollout_servers.server_syncs import WeightSyncs
from rollout_servers.worker_ext import PARTLY_LOADED

PLAN = plan_buckets([TensorSpec("w", (2, 3), "float32")], bucket_bytes=1 << 20)


class GatedLLM:
    """The ``AsyncLLM`` calls a full-weight sync makes; the receive waits for :attr:`gate`
    and then fails when :attr:`fail` is set."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.fail: str = ""  # the receive's error, when it fails
        self.calls: list[str] = []
        self.rpcs: list[str] = []  # the workers' methods called, in order
        self.pause_error = ""  # when set, the pause fails with it

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        if self.pause_error:
            raise RuntimeError(self.pause_error)
        self.calls.append("pause")

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[dict]:
        self.rpcs.append(method)
        await self.gate.wait()
        if self.fail:
            raise RuntimeError(self.fail)
        return [{}]

    async def reset_prefix_cache(self) -> None:
        pass

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(f"label {version}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")


def test_a_task_waits_for_the_version_it_was_dealt_at_until_loaded_failed_or_bounded():
    async def run() -> None:
        llm = GatedLLM()
        engine = RolloutEngine(llm)  # holds version 0
        assert await engine.reach(0, 5.0) == 0.0  # held already: no wait

        sync = asyncio.create_task(engine.sync_weights(1, PLAN, timeout_s=5.0))
        waiter = asyncio.create_task(engine.reach(1, 5.0))
        await asyncio.sleep(0.2)
        assert not waiter.done()  # version 1 is still being received
        llm.gate.set()
        await sync
        waited = await asyncio.wait_for(waiter, 1.0)
        assert engine.version == 1 and 0.2 <= waited < 1.0
        assert llm.calls == ["pause", "label 1", "resume"]

        # The sync of version 2 fails: the wait ends with it, under version 1.
        llm.gate.clear()
        llm.fail = "the broadcast broke off"
        sync = asyncio.create_task(engine.sync_weights(2, PLAN, timeout_s=5.0))
        waiter = asyncio.create_task(engine.reach(2, 5.0))
        await asyncio.sleep(0.05)
        llm.gate.set()
        with pytest.raises(RuntimeError, match="broke off"):
            await sync
        assert await asyncio.wait_for(waiter, 1.0) < 1.0 and engine.version == 1

        # No sync of version 3 comes (a server left out of a push): the bound ends it.
        assert 0.3 <= await engine.reach(3, 0.3) < 1.0 and engine.version == 1

        # A sync of an older version ending (a catch-up to 2 while the task waits for 4)
        # does not end the wait: a review found any sync's end did.
        llm.fail = ""
        llm.gate.clear()
        waiter = asyncio.create_task(engine.reach(4, 5.0))
        older = asyncio.create_task(engine.sync_weights(2, PLAN, timeout_s=5.0))
        await asyncio.sleep(0.05)
        llm.gate.set()
        await older
        await asyncio.sleep(0.2)
        assert engine.version == 2 and not waiter.done()
        await engine.sync_weights(4, PLAN, timeout_s=5.0)
        assert await asyncio.wait_for(waiter, 1.0) >= 0.2 and engine.version == 4

    asyncio.run(run())


def test_a_failed_sync_leaves_its_group_and_a_failed_pause_still_resumes():
    """After a failed receive the workers abort their group (``wsync_leave``: an NCCL
    broadcast left posted waits for the watchdog). A pause that fails in the abort mode
    used to leave every later generate waiting for a resume that never came."""

    async def run() -> None:
        llm = GatedLLM()
        llm.gate.set()
        engine = RolloutEngine(llm, sync_mode="abort")
        llm.fail = "the broadcast broke off"
        with pytest.raises(RuntimeError, match="broke off"):
            await engine.sync_weights(1, PLAN, timeout_s=5.0)
        assert llm.rpcs == ["wsync_receive", "wsync_leave"] and engine._resumed.is_set()
        llm.fail, llm.rpcs = "", []
        await engine.sync_weights(1, PLAN, timeout_s=5.0)
        assert llm.rpcs == ["wsync_receive"] and engine.version == 1  # no leave when it works

        llm.pause_error = "pause refused"
        with pytest.raises(RuntimeError, match="pause refused"):
            await engine.sync_weights(2, PLAN, timeout_s=5.0)
        assert engine._resumed.is_set() and engine.version == 1

    asyncio.run(run())


def test_a_worker_stuck_in_its_receive_makes_the_engine_count_as_dead():
    """Every wait in a worker's receive is bounded by the sync timeout, so a call that
    outlasts them all has a worker stuck in it, and every later call would queue behind
    it: the engine counts as dead (the server exits 4 and is restarted), generation is
    not resumed, and no leave is queued. The call used to be awaited without a bound,
    generation paused, and nothing said."""

    async def run() -> None:
        llm = GatedLLM()  # the gate stays shut: the receive never returns
        engine = RolloutEngine(llm)
        start = asyncio.get_running_loop().time()
        with pytest.raises(RuntimeError, match="wsync_receive did not end .* stuck"):
            await engine.sync_weights(1, PLAN, timeout_s=0.05)  # 1 bucket: bound 0.25 s
        assert asyncio.get_running_loop().time() - start < 2
        assert engine.errored and engine.version == 0 and "resume" not in llm.calls
        assert llm.rpcs == ["wsync_receive"]

    asyncio.run(run())


def test_a_resume_that_fails_still_lets_generation_and_deadlines_go_on():
    async def run() -> None:
        llm = GatedLLM()
        llm.gate.set()
        engine = RolloutEngine(llm, sync_mode="abort")

        async def refused() -> None:
            raise RuntimeError("resume refused")

        llm.resume_generation = refused  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="resume refused"):
            await engine.sync_weights(1, PLAN, timeout_s=5.0)
        paused = engine.paused_s()
        await asyncio.sleep(0.2)
        assert engine._resumed.is_set() and engine.paused_s() == paused  # the pause ended

    asyncio.run(run())


def test_weights_partly_loaded_hold_generation_until_a_whole_load():
    """A broadcast that breaks off after its first bucket (a member died mid-push) leaves
    the engine's weights part new, part old: generation stays paused (no resume, requests
    wait) until a later sync (the catch-up) loads them whole. The server used to exit, so
    one member's death restarted every server of the push."""

    async def run(mode: str) -> None:
        llm = GatedLLM()
        engine = RolloutEngine(llm, sync_mode=mode)
        llm.fail = f"{PARTLY_LOADED}: the broadcast broke off"
        llm.gate.set()
        with pytest.raises(RuntimeError, match=PARTLY_LOADED):
            await engine.sync_weights(1, PLAN, timeout_s=5.0)
        assert engine.partial and engine.version == 0
        # keep: requests stay frozen in the paused engine; abort: they wait to re-submit
        assert llm.calls == ["pause"] and engine._resumed.is_set() == (mode == "keep")
        # A catch-up that fails at its start (weights untouched: still partial) holds on.
        llm.fail = "no sender"
        with pytest.raises(RuntimeError, match="no sender"):
            await engine.sync_weights(1, PLAN, timeout_s=5.0)
        assert engine.partial and "resume" not in llm.calls
        llm.fail = ""
        await engine.sync_weights(1, PLAN, timeout_s=5.0)
        assert not engine.partial and engine.version == 1 and engine._resumed.is_set()
        assert llm.calls[-2:] == ["label 1", "resume"]

    for mode in ("keep", "abort"):
        asyncio.run(run(mode))


def test_a_server_holds_on_partial_weights_once_and_stops_if_a_catch_up_fails_on_them():
    """The server's verdict after a failed sync: partly loaded weights are not fatal (the
    engine holds generation; the coordinator schedules a catch-up), but a catch-up that
    fails with them still partial ends the server (exit 4, restarted with whole weights),
    as an engine that died always does."""
    from types import SimpleNamespace

    from rollout_servers.server import RolloutServer

    def verdict(errored: bool, partial: bool, was_partial: bool, catchup: bool = True) -> str:
        server = object.__new__(RolloutServer)
        server.engine = SimpleNamespace(errored=errored, partial=partial)  # type: ignore[assignment]
        server.fatal = ""
        server._check_engine(RuntimeError(f"{PARTLY_LOADED}: broke off"), was_partial, catchup)
        return server.fatal

    assert verdict(errored=False, partial=True, was_partial=False) == ""
    assert "stay partly loaded after a failed catch-up" in verdict(False, True, True)
    assert verdict(errored=False, partial=False, was_partial=True) == ""  # loaded whole
    assert "the vLLM engine died" in verdict(True, False, False)
    # A main round (a push) that fails on them: the catch-up is still to come
    assert verdict(errored=False, partial=True, was_partial=True, catchup=False) == ""


def test_a_failed_sync_on_partial_weights_is_reported_as_such_and_a_push_is_not_fatal():
    """The server's side of a failed sync: its report says the weights are partly loaded
    (its client registers them as such after a learner restart, for a catch-up), and only
    a failed catch-up on them ends the server, not a main round's push."""
    from types import SimpleNamespace

    from asyncrl.control import messages as m
    from rollout_servers.server import RolloutServer

    reports: list[tuple[int, bool, str]] = []

    async def run_now(fn, *args):
        return fn(*args)

    async def run() -> None:
        llm = GatedLLM()
        llm.gate.set()
        server = object.__new__(RolloutServer)
        server.engine = RolloutEngine(llm)
        server.fatal = ""
        client = SimpleNamespace(
            sync_done=lambda start, ok, error: reports.append((start.sync_id, ok, error)),
            registered=SimpleNamespace(
                sync_store_host="h", sync_store_port=1, sync_secret="", session="s"
            ),
        )
        lanes = SimpleNamespace(sync=run_now)
        syncs = WeightSyncs(server.engine, client, lanes, {}, False, server._check_engine)  # type: ignore[arg-type]
        syncs.generation = ("s", "main/1")

        def start(sync_id: int, catchup: bool) -> m.SyncStart:
            return m.SyncStart(
                sync_id=sync_id,
                version=1,
                generation="main/1",
                rank=1,
                world_size=2,
                plan=PLAN,
                catchup=catchup,
                session="s",
            )

        llm.fail = f"{PARTLY_LOADED}: the broadcast broke off"
        await syncs.sync(start(1, catchup=False))
        llm.fail = "no sender"
        await syncs.sync(start(2, catchup=False))  # a push fails on them: held on
        assert server.engine.partial and server.fatal == ""
        await syncs.sync(start(3, catchup=True))  # a catch-up fails on them: exit
        assert "after a failed catch-up" in server.fatal
        assert [(sid, ok) for sid, ok, _ in reports] == [(1, False), (2, False), (3, False)]
        assert all(error.startswith(m.WEIGHTS_PARTIAL) for _, _, error in reports)

    asyncio.run(run())


def test_the_hold_on_partial_weights_is_counted_as_sync_pause():
    """Generation held on partly loaded weights until the catch-up is paused for a sync:
    ``rollout/sync_pause_s`` counts it (the engine's pause clock), while the server's wait
    for tasks leaves it out. Only each attempt's own length was counted, so the hold was
    in no metric."""
    from rollout_servers.server_stats import ServerStats

    async def run() -> None:
        llm = GatedLLM()
        engine = RolloutEngine(llm)
        stats = ServerStats(tok=None)  # type: ignore[arg-type]
        stats.snapshot([engine.metrics], 0, engine.paused_s)  # idle, as the task loop is
        llm.fail = f"{PARTLY_LOADED}: the broadcast broke off"
        llm.gate.set()
        with pytest.raises(RuntimeError):
            await engine.sync_weights(1, PLAN, timeout_s=5.0)
        await asyncio.sleep(0.5)  # held, waiting for the catch-up
        held = stats.snapshot([engine.metrics], 0)
        assert held["rollout/sync_pause_s"] == pytest.approx(engine.paused_s(), abs=0.05)
        assert held["rollout/sync_pause_s"] >= 0.5
        llm.fail = ""
        await engine.sync_weights(1, PLAN, timeout_s=5.0)
        assert engine.metrics["rollout/sync_pause_s"] == pytest.approx(engine.paused_s())
        out = stats.snapshot([engine.metrics], 0)
        assert out["rollout/sync_pause_s"] == pytest.approx(engine.paused_s(), abs=0.01)
        assert out["rollout/task_wait_s"] < 0.1
        assert out["rollout/wait_fraction"] == pytest.approx(1.0, abs=0.05)

    asyncio.run(run())


def test_an_episode_deadline_does_not_run_during_a_sync_in_progress():
    """The engine counts the pause in progress (and the hold of partly loaded weights):
    an agent episode's deadline that would pass during a sync waits for the sync to end
    first, instead of ending the episode as ``timeout``, trained as the model's."""
    from rollout_servers.deadlines import Deadline

    async def run() -> None:
        llm = GatedLLM()
        engine = RolloutEngine(llm)
        deadline = Deadline(0.3, engine)
        sync = asyncio.create_task(engine.sync_weights(1, PLAN, timeout_s=5.0))
        await asyncio.sleep(0.6)  # past the 0.3 s, all of it paused
        assert 0.25 < deadline.left() <= 0.3
        llm.fail = f"{PARTLY_LOADED}: the broadcast broke off"
        llm.gate.set()
        with pytest.raises(RuntimeError):
            await sync
        await asyncio.sleep(0.2)  # held on partly loaded weights: still paused
        assert engine.partial and 0.25 < deadline.left() <= 0.3
        llm.fail = ""
        await engine.sync_weights(1, PLAN, timeout_s=5.0)  # the catch-up: resumed
        await asyncio.sleep(0.2)
        assert 0.0 < deadline.left() < 0.15 and engine.paused_s() > 0.8

    asyncio.run(run())


class EndingLLM:
    """Answers every request at once with two tokens and ``finish_reason``."""

    def __init__(self, finish_reason: str) -> None:
        self.finish_reason = finish_reason

    async def generate(self, prompt, params, request_id, lora_request=None):
        from types import SimpleNamespace

        done = SimpleNamespace(token_ids=[5, 6], logprobs=None, finish_reason=self.finish_reason)
        yield SimpleNamespace(outputs=[done])


@pytest.mark.parametrize(("reason", "fails"), [("abort", True), ("error", True), ("stop", False)])
def test_a_response_vllm_aborted_or_ended_in_error_fails_instead_of_training(reason, fails):
    """A review: an abort that was not a sync's (or an error) came back as a normal sample,
    its cut text scored and trained as if the policy had stopped there. It now fails the
    request, and with it the group, which is dealt again."""
    from vllm import SamplingParams

    engine = RolloutEngine(llm=EndingLLM(reason))
    params = SamplingParams(max_tokens=4, temperature=1.0)

    async def run():
        return await engine.generate([1, 2, 3], params, "r1")

    if fails:
        with pytest.raises(RuntimeError, match=f"finish_reason '{reason}'"):
            asyncio.run(run())
    else:
        assert asyncio.run(run()).token_ids == [5, 6]
