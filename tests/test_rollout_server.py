"""Real rollout servers (``asyncrl-rollout``: CPU vLLM, tiny model) with the coordinator of a
stand-in learner and the buffer service: groups stream in complete, admission holds both
servers to the budget, a push moves them on, a killed server comes back and catches up,
and every role exits 0 at shutdown.

One rig serves the tests of this module in order (starting vLLM costs ~30 s per server).
Its servers run vLLM's engine core as a child process (``rollout.inline_engine=false``, the
default off CPU), so that one test can kill that process under a live server; the launcher
tests run the CPU default, the engine core inside the server.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from asyncrl.net.buffer_client import BufferClient
from asyncrl.net.transport import config_endpoint
from asyncrl.tasks import prepare_task_data
from tests.helpers import kill_session, log_tails, wait_until
from tests.standins.learner import StandInLearner, loopback_config, model_weights, spawn_buffer

pytestmark = pytest.mark.slow

BATCH, N, LAG = 4, 4, 1


# Real vLLM servers on a loaded CPU: waits take minutes, not seconds.
_wait = functools.partial(wait_until, timeout_s=180.0, every_s=0.2)


class Rig:
    def __init__(self, tmp, tiny_model):
        prepare_task_data("arithmetic", tmp / "data", seed=0)
        self.cfg, self.config = loopback_config(
            tmp,
            [
                f"model.path={tiny_model}",
                f"data.train_files={tmp}/data/train.parquet",
                f"data.val_files={tmp}/data/val.parquet",
                f"data.train_batch_size={BATCH}",
                f"actor.ppo_mini_batch_size={BATCH}",
                f"rollout.n={N}",
                "rollout.max_inflight=32",
                f"staleness.max_policy_lag={LAG}",
                "data.max_response_length=6",
                "data.max_prompt_length=32",
                "rollout.temperature=0.7",
                "trainer.val_before_train=false",
                "trainer.test_freq=-1",
                "control.heartbeat_s=0.5",
                "control.dead_after_s=6",
                "control.tasks_per_request=2",
                "launch.start_timeout_s=120",
                "sync.timeout_s=60",
                "reward.num_workers=1",
                "rollout.inline_engine=false",  # an engine process to kill (see above)
            ],
        )
        self.tmp = tmp
        self.dead: set[str] = set()  # servers a test killed (their syncs may fail)
        self.weights = model_weights(str(tiny_model))
        self.learner = StandInLearner(self.cfg, tensors=self.weights).start()
        self.buffer = spawn_buffer(self.config, tmp / "buffer.log")
        self.servers = {sid: self.spawn(sid, core) for sid, core in (("r0", "0"), ("r1", "1"))}
        self.consumer = BufferClient(config_endpoint(self.cfg.endpoints, "batches"), "test")
        self.consumer.hello(wait_s=60)

    def spawn(self, server_id: str, core: str) -> subprocess.Popen:
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=core)
        log = open(self.tmp / f"{server_id}.log", "a")  # noqa: SIM115
        cmd = [
            sys.executable,
            "-m",
            "rollout_servers.main",
            str(self.config),
            "--server-id",
            server_id,
        ]
        # Its own session: a kill takes vLLM's engine and worker processes down with it,
        # as a crashed machine would.
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def metric(self, name: str) -> float:
        return self.learner.coordinator.metrics().get(name, 0.0)  # counters start absent

    def batch(self, version: int):
        """Take a batch as the learner does: what it takes counts as trained, which is what
        moves the admission window at the next push."""
        batch = self.consumer.request_batch(version, wait_s=2.0)
        if batch is not None:
            self.learner.coordinator.trained(batch.task_ids)
        return batch

    def push(self, seed: int) -> int:
        g = torch.Generator().manual_seed(seed)
        self.learner.set_weights(
            {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in self.weights.items()}
        )
        result = self.learner.push()
        assert not result.failed or set(result.failed) <= self.dead, result.failed
        return result.version

    def logs(self) -> str:
        return log_tails(self.tmp, 3000)

    def close(self):
        for proc in [*self.servers.values(), self.buffer]:
            kill_session(proc)
        self.consumer.close()
        self.learner.close()


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_model):
    rig = Rig(tmp_path_factory.mktemp("rollout"), tiny_model)
    yield rig
    rig.close()


def _check_group(group, versions: set[int]):
    assert len(group.trajectories) == N
    assert sorted(t.meta.group_index for t in group.trajectories) == list(range(N))
    for t in group.trajectories:
        assert t.meta.group_size == N and t.meta.response_len == len(t.logprobs) >= 1
        assert np.all(np.isfinite(t.logprobs)) and np.all(t.logprobs <= 0)
        assert sum(n for _, n in t.meta.version_spans) == t.meta.response_len
        assert {v for v, _ in t.meta.version_spans} <= versions
        assert t.meta.server_id in ("r0", "r1") and t.meta.data_source == "arithmetic"


def test_admission_holds_servers_to_the_budget_until_the_version_advances(rig):
    limit = (LAG + 0 + 1) * BATCH
    _wait(lambda: rig.metric("coordinator/budget/dealt") >= limit, "the first budget dealt")
    # The version stalls: nothing more is dealt while the servers ask (a request held by
    # the budget is a server asking right now).
    held = rig.metric("coordinator/waits/budget")
    _wait(
        lambda: rig.metric("coordinator/waits/budget") >= held + 2,
        "two more requests held by the budget",
    )
    assert rig.metric("coordinator/budget/dealt") == limit
    batches = [_wait(lambda: rig.batch(0), "a batch") for _ in range(limit // BATCH)]
    for batch in batches:
        for group in batch.groups:
            _check_group(group, {0})
    # Both servers ask (whichever registered first may have taken the whole budget).
    _wait(lambda: set(rig.learner.coordinator.servers()) == {"r0", "r1"}, "both registered")
    assert rig.metric("coordinator/budget/dealt") == limit
    assert rig.batch(0) is None  # all the budget's groups were released

    version = rig.push(seed=1)
    assert version == 1
    _wait(lambda: rig.metric("coordinator/budget/dealt") >= limit + BATCH, "dealing to resume")
    # The pushed weights trained on the `limit` groups taken above: the window moved by them.
    assert rig.metric("coordinator/budget/consumed") == limit
    assert rig.metric("coordinator/budget/dealt") <= limit + (LAG + 1) * BATCH
    batch = _wait(lambda: rig.batch(1), "a batch after the push")
    for group in batch.groups:
        _check_group(group, {0, 1})


def test_killed_server_restarts_catches_up_and_generates_with_current_version(rig):
    os.killpg(rig.servers["r1"].pid, signal.SIGKILL)
    rig.servers["r1"].wait(30)
    rig.dead.add("r1")
    _wait(lambda: "r1" not in rig.learner.coordinator.servers(), "r1 to be declared dead")
    version = rig.push(seed=2)  # without r1: the group is formed anew
    rig.servers["r1"] = rig.spawn("r1", "1")

    def caught_up():
        rig.learner.serve_catchups()
        servers = rig.learner.coordinator.servers()
        return servers.get("r1", {}).get("policy_version") == version

    _wait(caught_up, "r1 to re-register and catch up", every_s=0.5)
    version = rig.push(seed=3)  # a new version opens the budget; r1 is a member again
    seen = []

    def r1_generated():
        batch = rig.batch(rig.learner.coordinator.version)
        if batch is not None:
            seen.extend(t for t in batch.trajectories if t.meta.server_id == "r1")
        return seen

    _wait(r1_generated, "groups from the restarted r1")
    for t in seen:
        assert [v for v, _ in t.meta.version_spans] == [version], t.meta.version_spans


def test_a_server_whose_engine_dies_exits_4_and_its_tasks_are_dealt_again(rig):
    """vLLM's engine process dies under a live server (an OOM kill, a crash): the server
    cannot generate any more, so it exits 4 for its supervisor to restart it (also when it
    was idle, held back for a catch-up that cannot succeed), leaves, and the run goes on
    with the other; nothing is lost from the accounting."""
    import psutil

    server = rig.servers["r0"]
    # vLLM names its engine process (its reward workers are other children of the server).
    engine = [
        p
        for p in psutil.Process(server.pid).children(recursive=True)
        if "EngineCor" in p.name() or "EngineCore" in " ".join(p.cmdline())
    ]
    assert engine, [p.cmdline() for p in psutil.Process(server.pid).children(recursive=True)]
    left = rig.metric("coordinator/servers_left")
    for p in engine:
        p.kill()
    rig.dead.add("r0")
    rig.push(seed=4)  # new tasks for both: r0's next generation meets the dead engine
    assert server.wait(180) == 4, rig.logs()
    _wait(lambda: "r0" not in rig.learner.coordinator.servers(), "r0 to leave")
    # It left (taking nothing with it: what it held is dealt again), and the run goes on.
    assert rig.metric("coordinator/servers_left") == left + 1
    assert rig.metric("accounting/train/unaccounted") == 0
    _wait(lambda: rig.batch(rig.learner.coordinator.version), "a batch from r1 alone")
    # Its supervisor would restart it: so does the rig, for the last test.
    rig.servers["r0"] = rig.spawn("r0", "0")

    def caught_up():
        rig.learner.serve_catchups()
        servers = rig.learner.coordinator.servers()
        return servers.get("r0", {}).get("policy_version") == rig.learner.coordinator.version

    _wait(caught_up, "r0 to re-register and catch up", every_s=0.5)


def test_every_role_exits_zero_at_shutdown(rig):
    logs = {sid: rig.tmp / f"{sid}.log" for sid in rig.servers}
    offsets = {sid: path.stat().st_size for sid, path in logs.items()}
    assert rig.learner.shutdown("test done")
    start = time.monotonic()
    codes = {name: proc.wait(30) for name, proc in [*rig.servers.items(), ("buffer", rig.buffer)]}
    elapsed = time.monotonic() - start
    assert codes == {"r0": 0, "r1": 0, "buffer": 0}, rig.logs()
    assert elapsed < 20, f"roles took {elapsed:.1f}s to exit"
    for sid, path in logs.items():  # what each server wrote from the shutdown on
        with open(path, errors="replace") as f:
            f.seek(offsets[sid])
            tail = f.read()
        # AsyncLLM shuts itself down again when freed; left to the interpreter's exit, that
        # printed a TypeError traceback (rollout_servers.engine.RolloutEngine.shutdown)
        assert "Exception ignored" not in tail and "Traceback" not in tail, tail[-3000:]
        # Every push reloads the weights; vLLM names each layer the push left out, and the
        # tied head and the rotary cache are left out by design (worker_ext.ExpectedReloadGaps).
        assert "Failed to load weights" not in path.read_text(errors="replace")
