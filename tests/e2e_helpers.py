"""What the end-to-end tests share: a run's command line, its overrides, and checks on it.

Every run uses the demo config with fresh ports, the run directory under the test's
``tmp_path``, and the demo's flattened tiny model (the one that learns in a few dozen
steps); the tests override what they exercise.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import endpoint_overrides, log_tails

RUN = Path("asyncrl") / "cpu_demo"  # <default_local_dir>/<project>/<experiment>


def run_overrides(tmp_path: Path, model: Path, data_dir: Path, steps: int) -> list[str]:
    """Overrides that put a demo run on fresh ports, in ``tmp_path``, for ``steps`` steps."""
    return [
        f"model.path={model}",
        f"data.train_files={data_dir}/train.parquet",
        f"data.val_files={data_dir}/val.parquet",
        f"trainer.default_local_dir={tmp_path}",
        f"trainer.total_training_steps={steps}",
        "launch.start_timeout_s=240",
        # Both servers on core 1, as the demo was until it gave each server a core: the
        # bounds these runs assert (lag drops, batch waits) were measured in this layout,
        # where the learner's core does not slow one server down. Pinning is speed only.
        "launch.cpus.rollout=[[1],[1]]",
        *endpoint_overrides(),
    ]


def wait_for_step(proc: subprocess.Popen, run: Path, log: Path, n: int, timeout_s: float) -> None:
    """Wait until the launched run has trained step ``n``; fail at once, with the
    launcher's output and the roles' logs, if the launcher ended before."""
    from asyncrl.metrics import read_metrics
    from tests.helpers import wait_until

    def reached() -> bool:
        if proc.poll() is not None:
            raise AssertionError(log.read_text()[-3000:] + role_logs(run))
        return run.exists() and any(r["step"] >= n for r in trained_steps(read_metrics(run)))

    wait_until(reached, f"step {n}", timeout_s, every_s=0.5)


def launch_cmd(overrides: list[str], config: str = "configs/cpu_demo.yaml") -> list[str]:
    return [sys.executable, "-m", "asyncrl.launch", config, *overrides]


def role_logs(run: Path) -> str:
    """The last lines of every role's log, for assertion messages."""
    return log_tails(run / "logs")


def trained_steps(records: list[dict]) -> list[dict]:
    """The learner's per-step records: those with a policy-gradient loss, and the steps
    of ``trainer.critic_warmup`` (the critic trains alone: a value loss, no policy one)."""
    return [r for r in records if "loss/pg" in r or "critic/vf_loss" in r]


def rollout_wait_fraction(records: list[dict], skip: int = 1) -> float:
    """Share of the servers' time spent idle waiting for tasks or paused for a sync, between
    the end of step ``skip`` and the last step (from their cumulative totals; the engines'
    start-up is outside the window). The servers' own uptime is the denominator: it is
    taken in the same heartbeat as their waits, where a record's time is not (a record may
    repeat an older heartbeat's totals, and a late heartbeat would count as busy time)."""
    steps = trained_steps(records)
    a, b = steps[skip - 1], steps[-1]
    waited = sum(b[k] - a[k] for k in ("rollout/task_wait_s", "rollout/sync_pause_s"))
    return waited / (b["rollout/uptime_s"] - a["rollout/uptime_s"])


def validation(records: list[dict]) -> list[tuple[int, float, float]]:
    """``(step, score, standard error)`` of every validation round, in order."""
    return [
        (r["step"], r["val/score"], r.get("val/score_se", math.nan))
        for r in records
        if "val/score" in r
    ]


def assert_learned(records: list[dict]) -> None:
    """The last validation score beats the first by more than 2 standard errors of the
    difference (validation prompts are disjoint from training ones)."""
    vals = validation(records)
    assert len(vals) >= 2, vals
    (_, first, se0), (_, last, se1) = vals[0], vals[-1]
    se = math.hypot(se0, se1)
    assert se > 0 and last - first > 2 * se, f"validation {first:.3f} -> {last:.3f}, SE {se:.3f}"


def assert_vllm_loads(path: Path) -> None:
    """vLLM (CPU) loads the exported HF checkpoint and generates from it."""
    code = (
        "from vllm import LLM, SamplingParams\n"
        f"llm = LLM(model={str(path)!r}, dtype='float32', enforce_eager=True, max_model_len=64)\n"
        "out = llm.generate(['1+2='], SamplingParams(max_tokens=2, temperature=0))\n"
        "print('generated', len(out[0].outputs[0].token_ids))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "generated" in proc.stdout, proc.stderr[-2000:]


# ----------------------------------------------------------------------- chaos
def procs() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process on the machine."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmd)
    return out


def descendants(root: int) -> set[int]:
    """Every live descendant of ``root``."""
    table = procs()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    frontier = [root]
    while frontier:
        for pid in children.get(frontier.pop(), []):
            if pid not in found:
                found.add(pid)
                frontier.append(pid)
    return found


class ChaosRun:
    """A run under ``asyncrl-launch`` seen from outside while faults are injected: its
    trained steps, its roles' current pids and logs (read as they grow), ``kill -9`` of a
    role, and every pid the run ever had (to check that none outlives the launcher).

    :meth:`drive` consumes a list of actions, each a callable that is called on every look
    at the run until it returns true (it fired); the next one is armed only then. It waits
    for the launcher to exit; a timeout stops the run (SIGTERM) and fails the test."""

    def __init__(self, tmp_path: Path, overrides: list[str]):
        self.run = tmp_path / RUN
        self.out_path = tmp_path / "launch.out"
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(
                launch_cmd(overrides), stdout=out, stderr=subprocess.STDOUT
            )
        self.seen: set[int] = set()
        self.kills: list[tuple[str, int, float]] = []  # (role, pid, time)
        self._text: dict[str, str] = {}
        self._offset: dict[str, int] = {}
        self.every_s = 0.5  # how often drive() looks: an action may make it look faster

    def grown(self, rel: str) -> str:
        """The text of ``<run dir>/<rel>`` so far, read incrementally."""
        path = self.run / rel
        if not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(self._offset.get(rel, 0))
            data = f.read()
        self._offset[rel] = self._offset.get(rel, 0) + len(data)
        self._text[rel] = self._text.get(rel, "") + data.decode(errors="replace")
        return self._text[rel]

    def records(self) -> list[dict]:
        """The learner's step records so far (complete lines only)."""
        import json

        out = []
        for line in self.grown("metrics.jsonl").splitlines():
            if '"loss/pg"' in line:
                try:
                    out.append(json.loads(line))
                except ValueError:  # the line being written
                    continue
        return out

    def last_step(self) -> int:
        """The step of the latest step record (0 before the first): after a learner restart
        it starts again from the checkpoint's step."""
        recs = self.records()
        return int(recs[-1]["step"]) if recs else 0

    def pid(self, role: str) -> int | None:
        import json

        try:
            return json.loads((self.run / "pids.json").read_text())["roles"].get(role)
        except (OSError, ValueError):  # not written yet, or being replaced
            return None

    def kill(self, role: str) -> int:
        """SIGKILL ``role``'s own process (its tree is the launcher's to clear)."""
        import os
        import signal
        import time

        pid = self.pid(role)
        assert pid is not None, f"{role} is not running"
        os.kill(pid, signal.SIGKILL)
        self.kills.append((role, pid, time.time()))
        return pid

    def drive(self, actions: list, timeout_s: float) -> int:
        """Apply ``actions`` in order while the run goes on; the launcher's exit code."""
        import time

        deadline = time.monotonic() + timeout_s
        pending = list(actions)
        scanned = 0.0
        try:
            while self.proc.poll() is None:
                now = time.monotonic()
                assert now < deadline, "the run did not end in time" + self.logs()
                if now - scanned >= 0.5:  # the process table is costly to read
                    self.seen |= descendants(self.proc.pid)
                    scanned = now
                if pending and self.run.exists() and pending[0](self):
                    pending.pop(0)
                time.sleep(self.every_s)
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                self.proc.wait(120)
        assert not pending, f"the run ended before {len(pending)} actions fired" + self.logs()
        return self.proc.returncode

    def logs(self) -> str:
        return "\n" + self.out_path.read_text()[-3000:] + role_logs(self.run)

    def left(self) -> dict[int, str]:
        """The run's processes still alive (none should be once the launcher exited)."""
        from tests.helpers import alive

        return {p: cmd for p, (_, cmd) in procs().items() if p in self.seen and alive(p)}


class AgentGroups:
    """Outside agents on one server's OpenAI endpoint during a :class:`ChaosRun`: every
    session of every group starts at the same moment (one thread each), asks one
    completion (retrying 429s: the staleness budget), then sends its reward."""

    def __init__(self, run: Path, server: str, groups: tuple[str, ...], members: tuple[str, ...]):
        from concurrent.futures import ThreadPoolExecutor

        self.url_file = run / "openai_endpoints" / f"{server}.json"
        self.keys = [f"{g}/{m}" for g in groups for m in members]
        self.pool = ThreadPoolExecutor(max_workers=len(self.keys))
        self.futures: dict = {}
        self.results: dict[str, dict] = {}

    def open_after(self, step: int):
        """An action: open every session once the learner trained ``step``."""
        import json
        import threading

        def act(chaos: ChaosRun) -> bool:
            if chaos.last_step() < step or not self.url_file.exists():
                return False
            base = json.loads(self.url_file.read_text())["base_url"]
            start = threading.Barrier(len(self.keys))
            for i, key in enumerate(self.keys):
                self.futures[key] = self.pool.submit(self._session, base, key, i % 2, start)
            return True

        return act

    def rewarded(self, chaos: ChaosRun) -> bool:
        """An action: every session has sent its reward (raises what a session raised)."""
        if not all(f.done() for f in self.futures.values()):
            return False
        self.results = {key: f.result() for key, f in self.futures.items()}
        return True

    def complete(self) -> dict[str, bool]:
        """Group -> whether a reward completed it."""
        out: dict[str, bool] = {}
        for key, result in self.results.items():
            group = key.split("/")[0]
            out[group] = out.get(group, False) or bool(result.get("group_complete"))
        return out

    @staticmethod
    def _session(base: str, key: str, reward: float, start) -> dict:
        import time

        import httpx

        headers = {"Authorization": f"Bearer {key}"}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "3+4="}], "max_tokens": 4}
        start.wait(30)
        deadline = time.monotonic() + 300
        while True:
            reply = httpx.post(f"{base}/chat/completions", json=body, headers=headers, timeout=120)
            if reply.status_code != 429:
                break
            assert time.monotonic() < deadline, f"{key}: no slot within 300 s"
            time.sleep(0.5)
        assert reply.status_code == 200, f"{key}: {reply.status_code} {reply.text}"
        root = base.removesuffix("/v1")
        done = httpx.post(f"{root}/rl/reward", json={"reward": reward}, headers=headers)
        assert done.status_code == 200, f"{key}: {done.status_code} {done.text}"
        return done.json()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def documented_metrics(path: str = "learner/METRICS.md") -> list[re.Pattern[str]]:
    """The metric names ``learner/METRICS.md`` lists (each table row's first column), as
    patterns: ``<x>`` stands for one name part; ``/std`` after ``reward/mean`` is
    ``reward/std``, ``.../consumed`` a sibling, ``_max`` after ``..._mean`` its twin."""
    patterns, prev = [], ""
    for line in (Path(__file__).parents[1] / path).read_text().splitlines():
        if not line.startswith("| `"):
            continue
        for name in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if name.startswith(".../"):
                name = prev.rsplit("/", 1)[0] + name[3:]
            elif name.startswith("/"):
                name = prev.rsplit("/", 1)[0] + name
            elif name.startswith("_") and prev:
                name = prev.rsplit("_", 1)[0] + name
            if "/" not in name:
                continue
            prev = name
            rx = re.sub(
                r"<[^>]+>", "[^/]+", re.escape(name).replace(r"\<", "<").replace(r"\>", ">")
            )
            patterns.append(re.compile(rx))
    return patterns


def undocumented_metrics(records: list[dict]) -> list[str]:
    """Metric names in ``records`` (a run's metrics.jsonl) that METRICS.md does not list."""
    patterns = documented_metrics()
    keys = {k for r in records for k in r if "/" in k}
    return sorted(k for k in keys if not any(p.fullmatch(k) for p in patterns))
