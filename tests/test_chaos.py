"""Chaos: ``kill -9`` roles of a real run under ``asyncrl-launch`` mid-training and check that
the run survives it.

Every run uses the demo's config and model, two CPU vLLM rollout servers and (but one)
checkpoints every 5 steps. Each must reach its last step with exit 0, every step trained by
the final weights' lineage, the accounting identity holding exactly at the end (``dealt = in
flight + in buffer + trained + dropped + given up``, with ``trained`` equal to what the
learner consumed, so no group was trained twice), few groups dropped for lag after the
restart, the recovery itself seen (the killed role's restart in ``launch.jsonl``, the
servers registered again, the replayed versions after a learner restart), and no process of
the run left once the launcher is gone.

Scenarios: one role killed (a rollout server, the buffer, the learner); the learner killed
in a run without checkpoints (``trainer.save_freq=-1``); the buffer, then the learner; the
learner killed while it pushes weights; two groups of the OpenAI endpoint opened at once,
then the learner killed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncrl.launch.progress import accounting_lines
from asyncrl.metrics import read_metrics
from tests.e2e_helpers import AgentGroups, ChaosRun, run_overrides, trained_steps

pytestmark = pytest.mark.slow

STEPS, BATCH = 30, 16  # the demo's data.train_batch_size
Action = Callable[[ChaosRun], bool]


def kill_after(role: str, step: int) -> Action:
    """Kill ``role`` once the learner's latest step is ``step`` or later; looks every 50 ms
    while armed. The demo's steps take 0.05-0.4 s: at the run's usual 0.5 s a learner killed
    "after step 13" once died after step 15, past the checkpoint the test meant it to replay
    from."""

    def act(run: ChaosRun) -> bool:
        run.every_s = 0.05
        if run.last_step() < step or run.pid(role) is None:
            return False
        run.kill(role)
        run.every_s = 0.5
        return True

    return act


CHECKPOINT_SAVED = re.compile(r"checkpoint saved: .* \(policy version (\d+)\)")
PUSH_DONE = re.compile(r"sync \d+ \(version (\d+)\) done in .*: ok \[([^\]]*)\]")


def kill_learner_ahead_of_its_checkpoint(step: int) -> Action:
    """Kill the learner once its latest step is ``step`` or later and both servers loaded
    a version above its last checkpoint's (its log says so): the restart's replay then
    has a push to skip (check_replayed). A kill after the step alone once landed while
    the first push past the checkpoint still ran: the servers held the checkpoint's
    version, and nothing was replayed."""

    def act(run: ChaosRun) -> bool:
        run.every_s = 0.05
        if run.last_step() < step or run.pid("learner") is None:
            return False
        life = learner_lives(run.run)[-1]
        saved = [int(v) for v in CHECKPOINT_SAVED.findall(life)]
        loaded = [
            int(v) for v, ok in PUSH_DONE.findall(life) if "rollout-0" in ok and "rollout-1" in ok
        ]
        if not saved or not loaded or max(loaded) <= saved[-1]:
            return False
        run.kill("learner")
        run.every_s = 0.5
        return True

    return act


def overrides(tmp_path: Path, demo_model, data, steps: int = STEPS, *extra: str) -> list[str]:
    return [
        *run_overrides(tmp_path, demo_model, data, steps),
        "trainer.save_freq=5",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "staleness.max_policy_lag=1",
        "control.heartbeat_s=0.5",
        "control.dead_after_s=8",
        "launch.restart_backoff_s=1",
        *extra,
    ]


# ----------------------------------------------------------------------- checks
def events(run: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run / "launch.jsonl").read_text().splitlines()]


def final_accounting(records: list[dict], steps: int = STEPS) -> dict:
    """The accounting at the end: exact, and ``trained`` what the learner consumed (each
    step's batch of distinct groups, once: a group trained twice would leave it short)."""
    acct = [r for r in records if "accounting/train/dealt" in r][-1]
    print("\n" + "; ".join(accounting_lines([acct])))
    for kind in ("train", "val"):
        assert acct[f"accounting/{kind}/unaccounted"] == 0, acct
    assert acct["accounting/train/trained"] == steps * BATCH, acct
    return acct


def learner_lives(run: Path) -> list[str]:
    """The learner's log, one text per start."""
    text = (run / "logs" / "learner.log").read_text(errors="replace")
    return [part for part in re.split(r"^---- learner start \d+ at .*$", text, flags=re.M)][1:]


def check_end(chaos: ChaosRun, code: int, steps: int = STEPS) -> list[dict]:
    """What every scenario ends with; returns the metrics records."""
    from tests.helpers import wait_until

    assert code == 0, chaos.logs()
    records = read_metrics(chaos.run)
    done = {r["step"] for r in trained_steps(records)}
    assert done == set(range(1, steps + 1)), sorted(done)
    wait_until(lambda: not chaos.left(), "the run's processes to be reaped", 5, details=chaos.left)
    return records


def check_restarted(run: Path, role: str, times: int = 1) -> None:
    """``role`` was restarted ``times`` times after dying of SIGKILL, and started again."""
    ev = [e for e in events(run) if e["role"] == role]
    restarts = [e for e in ev if e["event"] == "restart"]
    assert [e["exit_code"] for e in restarts] == [137] * times, ev
    assert [e["attempt"] for e in ev if e["event"] == "start"] == list(range(1, times + 2)), ev


def check_servers_back(run: Path) -> None:
    """Both servers registered with the restarted learner's coordinator."""
    last = learner_lives(run)[-1]
    for server in ("rollout-0", "rollout-1"):
        assert f"server {server} registered" in last, last[-3000:]


def check_replayed(records: list[dict], kill_time: float) -> None:
    """After a learner restart from a checkpoint the servers kept the versions the replay
    reproduces: pushes skipped (``sync/replayed``), counted by the coordinator."""
    after = [r for r in records if r["time"] > kill_time]
    assert sum(r.get("sync/replayed", 0) for r in after) >= 1, "no push was replayed"
    assert max(r.get("coordinator/versions_replayed", 0) for r in after) >= 1


def check_lag(acct: dict, records: list[dict]) -> None:
    """Few groups dropped for lag: at most ``LAG_BOUND``. A failure shows when the drops
    came (seconds into the run, the step, the coordinator's version), to tell a recovery
    that threw work away from a slow machine's ordinary drops."""
    dropped = acct["accounting/train/dropped/lag"]
    if dropped <= LAG_BOUND:
        return
    t0, seen, when = records[0]["time"], 0.0, []
    for r in records:
        n = r.get("accounting/train/dropped/lag", seen)
        if n != seen:
            when.append(f"t={r['time'] - t0:.1f}s step {r.get('step')}: {seen:g} -> {n:g}")
            when[-1] += f" (version {r.get('coordinator/version')})"
            seen = n
    raise AssertionError(f"{dropped:g} groups dropped for lag > {LAG_BOUND}: " + "; ".join(when))


# Groups dropped for lag at most, in every scenario: a tenth of the 480 trained. At
# max_policy_lag=1 drops come without any fault too (a long answer overtaken by shorter
# ones), a batch or two at a time, and how many depends on the machine's timing: the same
# scenarios dropped 0 to 16 in runs here (README table) and 33 (the buffer killed) and 36
# (the learner killed) in one CI run on a machine like this one, where per-scenario bounds
# of the measured count plus one batch failed. A recovery that throws its outstanding work
# away drops the whole window, in flight and buffered (64 groups), at once; what a replay or
# a re-deal must do is checked directly (check_replayed, the restart events).
LAG_BOUND = STEPS * BATCH // 10


# ----------------------------------------------------------------------- one role
TARGETS = {  # role -> step after which it is killed
    "rollout-0": 3,
    "buffer": 8,
    "learner": 13,  # checkpoint at 10: steps 11-13 are trained again
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("role", list(TARGETS))
def test_a_run_survives_kill_9_of_a_role(tmp_path, demo_model, arithmetic_data, role):
    step = TARGETS[role]
    steps = STEPS
    chaos = ChaosRun(tmp_path, overrides(tmp_path, demo_model, arithmetic_data, steps))
    kill = (
        kill_learner_ahead_of_its_checkpoint(step) if role == "learner" else kill_after(role, step)
    )
    code = chaos.drive([kill], timeout_s=780)
    records = check_end(chaos, code, steps)
    acct = final_accounting(records, steps)
    check_lag(acct, records)
    check_restarted(chaos.run, role)
    _, _, killed_at = chaos.kills[0]
    if role == "learner":
        check_servers_back(chaos.run)
        check_replayed(records, killed_at)
        # The buffer lived on: it got no second copy of a group (nothing dealt twice).
        last = trained_steps(records)[-1]
        assert last["buffer/drops/duplicate"] == last["buffer/drops/duplicate_groups"] == 0, last
    if role == "rollout-0":
        _check_server_kill(chaos, records, killed_at)


def _check_server_kill(chaos: ChaosRun, records: list[dict], killed_at: float) -> None:
    """The launcher told the coordinator at once (a Leave naming the dead process), so the
    learner never waited long for a batch (it waited ``control.dead_after_s`` and more
    before). Whether the restarted server registers again before the run ends depends on
    how fast its engine starts against how fast the run goes (a run of 90 steps ended
    first on a quiet machine): that a restarted server registers and catches up is
    tests/test_rollout_server.py's."""
    _, pid, _ = chaos.kills[0]
    leaves = [e for e in events(chaos.run) if e["event"] == "leave"]
    assert [(e["role"], e["pid"], e["ok"]) for e in leaves] == [("rollout-0", pid, True)]
    waits = [r["timing/wait_batch_s"] for r in trained_steps(records) if r["time"] > killed_at]
    assert max(waits) < 5.0, waits


# ----------------------------------------------------------------------- the learner
@pytest.mark.timeout(900)
def test_a_learner_without_checkpoints_starts_over(tmp_path, demo_model, arithmetic_data):
    """``trainer.save_freq=-1`` (veRL's default): nothing to resume to, so the restarted
    learner starts over from step 1, and the run still ends with every task accounted."""
    args = overrides(tmp_path, demo_model, arithmetic_data, STEPS, "trainer.save_freq=-1")
    chaos = ChaosRun(tmp_path, args)
    code = chaos.drive([kill_after("learner", 8)], timeout_s=780)
    records = check_end(chaos, code)
    acct = final_accounting(records)
    check_lag(acct, records)
    check_restarted(chaos.run, "learner")
    check_servers_back(chaos.run)
    _, _, killed_at = chaos.kills[0]
    again = [r["step"] for r in trained_steps(records) if r["time"] > killed_at]
    assert again == list(range(1, STEPS + 1)), again
    # The new learner counts versions from where the coordinator went on (above what the
    # buffer had seen): a review found its first steps' lags negative.
    lags = [r["lag/mean"] for r in trained_steps(records) if "lag/mean" in r]
    assert min(lags) >= 0, lags


@pytest.mark.timeout(900)
def test_a_run_survives_the_buffer_then_the_learner(tmp_path, demo_model, arithmetic_data):
    """The buffer dies (a new buffer session), then the learner (checkpoint at 10): the
    batches after the checkpoint come from the new buffer session."""
    chaos = ChaosRun(tmp_path, overrides(tmp_path, demo_model, arithmetic_data))
    code = chaos.drive(
        [kill_after("buffer", 5), kill_learner_ahead_of_its_checkpoint(13)], timeout_s=780
    )
    records = check_end(chaos, code)
    acct = final_accounting(records)
    check_lag(acct, records)
    check_restarted(chaos.run, "buffer")
    check_restarted(chaos.run, "learner")
    check_servers_back(chaos.run)
    check_replayed(records, chaos.kills[1][2])


SYNC_START = re.compile(r"sync (\d+): version (\d+) to ")


def kill_mid_push(first_version: int) -> Action:
    """Kill the learner between a push's start (version ``first_version`` or later) and
    its end, as its log shows them; looks every 10 ms while armed. Fires once the kill
    landed mid-push (the dead learner's log has no end of that push); a kill that came too
    late (the push ended first) is retried at the restarted learner's next push."""
    state: dict[str, tuple[int, int] | None] = {"pending": None}

    def act(run: ChaosRun) -> bool:
        run.every_s = 0.01
        lives = learner_lives(run.run) if run.grown("logs/learner.log") else []
        if state["pending"] is not None:  # a kill made: did it land mid-push?
            sync_id, version = state["pending"]
            if len(lives) < len(run.kills) + 1:
                return False  # the learner has not started again yet
            died = lives[len(run.kills) - 1]
            if f"sync {sync_id} (version {version}) done" not in died:
                run.every_s = 0.5
                return True
            state["pending"] = None
            assert len(run.kills) < 3, "three kills missed a push"
        if not lives or run.pid("learner") is None:
            return False
        starts = [tuple(map(int, m.groups())) for m in SYNC_START.finditer(lives[-1])]
        if not starts or starts[-1][1] < first_version:
            return False
        sync_id, version = starts[-1]
        if f"sync {sync_id} (version {version}) done" in lives[-1]:
            return False
        run.kill("learner")
        state["pending"] = (sync_id, version)
        return False

    return act


@pytest.mark.timeout(900)
def test_a_learner_killed_mid_push(tmp_path, demo_model, arithmetic_data):
    """The learner dies while the servers receive a push (after the checkpoint at step
    10): the servers register with the restarted learner (which pushes what none of them
    got), and the run ends with every task accounted."""
    chaos = ChaosRun(tmp_path, overrides(tmp_path, demo_model, arithmetic_data))
    code = chaos.drive([kill_mid_push(first_version=6)], timeout_s=780)
    records = check_end(chaos, code)
    acct = final_accounting(records)
    check_lag(acct, records)
    check_restarted(chaos.run, "learner", times=len(chaos.kills))
    check_servers_back(chaos.run)


@pytest.mark.timeout(900)
def test_endpoint_groups_then_a_learner_kill(tmp_path, demo_model, arithmetic_data):
    """Two groups of the OpenAI endpoint opened at once on one server (each takes its own
    external slot), both rewarded, then the learner killed: the external slots are
    accounted like dataset tasks through the restart."""
    args = overrides(
        tmp_path,
        demo_model,
        arithmetic_data,
        STEPS,
        "rollout.openai_endpoint.enable=true",
        "rollout.openai_endpoint.group_size=2",
    )
    chaos = ChaosRun(tmp_path, args)
    agents = AgentGroups(chaos.run, "rollout-0", groups=("g0", "g1"), members=("a", "b"))
    try:
        code = chaos.drive(
            [agents.open_after(2), agents.rewarded, kill_after("learner", 13)], timeout_s=780
        )
    finally:
        agents.close()
    records = check_end(chaos, code)
    acct = final_accounting(records)
    check_lag(acct, records)
    check_restarted(chaos.run, "learner")
    check_servers_back(chaos.run)
    assert agents.complete() == {"g0": True, "g1": True}, agents.results
    dealt = max(r.get("coordinator/tasks/external_dealt", 0) for r in records)
    assert dealt == 2, dealt  # one slot per group, none shared, none dealt twice


# ----------------------------------------------------------------------- LoRA adapters
@pytest.mark.timeout(900)
def test_pushed_adapters_survive_a_server_then_a_learner_kill(
    tmp_path, demo_model, arithmetic_data
):
    """LoRA with pushed adapters (``sync.lora: adapter``): a rollout server dies, then the
    learner (it resumes from an adapter-only checkpoint and pushes adapters again to the
    servers that join its new group); every step is trained, the accounting holds, and
    after every sync the engines scored the probe as the learner does (the adapter path,
    not the base weights)."""
    args = overrides(
        tmp_path,
        demo_model,
        arithmetic_data,
        STEPS,
        "model.lora_rank=8",
        "model.lora_alpha=16",
        "actor.optim.lr=2e-3",
        "sync.lora=adapter",
    )
    chaos = ChaosRun(tmp_path, args)
    code = chaos.drive([kill_after("rollout-0", 3), kill_after("learner", 13)], timeout_s=780)
    records = check_end(chaos, code)
    final_accounting(records)
    check_restarted(chaos.run, "rollout-0")
    check_restarted(chaos.run, "learner")
    # rollout-1 joined the restarted learner's sync group and took adapters from it (the
    # restarted rollout-0 may start its engine after the run ended: _check_server_kill).
    assert "server rollout-1 registered" in learner_lives(chaos.run)[-1]
    probes = [r["sync/probe_kl"] for r in records if "sync/probe_kl" in r]
    assert probes and max(abs(p) for p in probes) < 1e-3, probes
    logs = "".join(
        (chaos.run / "logs" / f"rollout-{i}.log").read_text(errors="replace") for i in (0, 1)
    )
    assert "adapter of version" in logs and "weights of version" not in logs
    checkpoint = max((chaos.run / "checkpoints").glob("step_*"))
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("model.")]
    assert weights and all(".lora_" in k for k in weights), weights[:4]
    # The end: the merged model and the adapter in peft's format.
    assert (chaos.run / "final" / "model.safetensors").exists()
    assert (chaos.run / "final_adapter" / "adapter_config.json").exists()
