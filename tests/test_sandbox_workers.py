"""The killable worker pool under scorers that start processes, fork, exit, are async, or
are stopped mid-job; with real worker processes (a RewardPool over a scorer file)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.rewards import RewardPool, ScoreResult
from tests.helpers import alive, wait_until

ROOT = Path(__file__).resolve().parents[1]

SCORER = """
import asyncio, gc, multiprocessing, os, subprocess, sys, time
from concurrent.futures import ProcessPoolExecutor

_calls = 0
_loop = None

def _put_length(queue, text):
    queue.put(float(len(text)))

def _start_sleeper(pid_file):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(pid_file, "a") as f:
        f.write(f"{child.pid}\\n")

class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str")

class UnprintableRuntime(RuntimeError):
    def __str__(self):
        raise ValueError("no str")

async def _async(solution_str):
    global _loop
    await asyncio.sleep(0.01)
    same = asyncio.get_running_loop() is _loop
    _loop = asyncio.get_running_loop()
    return {"score": float(len(solution_str)), "same_loop": float(same)}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global _calls
    _calls += 1
    if data_source == "pid":
        return float(os.getpid())
    if data_source == "mp_process":  # veRL prime_code's pattern: a child process per check
        queue = multiprocessing.Queue()
        process = multiprocessing.Process(target=_put_length, args=(queue, solution_str))
        process.start()
        process.join(10)
        return queue.get(timeout=5)
    if data_source == "mp_pool":
        with ProcessPoolExecutor(1) as executor:
            return float(executor.submit(len, solution_str).result(timeout=10))
    if data_source == "async":
        return _async(solution_str)
    if data_source == "child_then_hang":  # a code runner whose program never ends
        _start_sleeper(ground_truth)
        time.sleep(300)
    if data_source == "wait_all":  # fork once, then reap until no child is left
        if os.fork() == 0:
            os._exit(0)
        while True:
            try:
                os.wait()
            except ChildProcessError:
                return 1.0
    if data_source == "child_left_behind":
        _start_sleeper(ground_truth)
        return 1.0
    if data_source == "spin":
        end = time.time() + float(solution_str)
        while time.time() < end:
            pass
        return 1.0
    if data_source == "sleep":
        time.sleep(float(solution_str))
        return 1.0
    if data_source == "fork":  # a fork whose child returns instead of calling os._exit
        pid = os.fork()
        if pid == 0:
            time.sleep(0.2)
            return 0.25
        return float(len(solution_str))
    if data_source == "fork_raise":  # a fork whose child raises instead of calling os._exit
        pid = os.fork()
        if pid == 0:
            time.sleep(0.2)
            raise ValueError("model code failed in the child")
        os.waitpid(pid, 0)
        return float(len(solution_str))
    if data_source == "stale":  # an extra answer on the worker's pipe, as for the last job
        from multiprocessing.connection import Connection
        conn = next(o for o in gc.get_objects() if isinstance(o, Connection) and not o.closed
                    and o.readable and o.writable)
        conn.send((_calls - 1, ("ok", (0.25, {}))))
        return float(len(solution_str))
    if data_source == "sys_exit":
        sys.exit(0)
    if data_source == "exit":
        exit(3)
    if data_source == "unprintable":
        raise Unprintable()
    if data_source == "unprintable_runtime":  # read for the memory cap's words first
        raise UnprintableRuntime()
    return 1.0
"""


@pytest.fixture(scope="module")
def scorer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    file = tmp_path_factory.mktemp("sandbox") / "scorer.py"
    file.write_text(SCORER)
    return file


@pytest.fixture(scope="module")
def pool(scorer: Path) -> Iterator[RewardPool]:
    with RewardPool(num_workers=1, timeout_s=10.0, custom_path=str(scorer)) as pool:
        yield pool


def run_script(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``body`` in a fresh interpreter in its own session (its signals reach no test).

    Its output goes to files, not pipes: workers inherit them, and a worker that outlived
    the script would hold a pipe open, so the wait would measure the worker, not the script.
    """
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(body)],
            env=env,
            stdout=out,
            stderr=err,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
        out.seek(0)
        err.seek(0)
        done.stdout, done.stderr = out.read(), err.read()
    return done


def pids_in(file: Path) -> list[int]:
    return [int(pid) for pid in file.read_text().split()] if file.exists() else []


def live_children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` and that still run (zombies do not count)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == pid and state != "Z":
                found.append(int(entry.name))
    return found


# ----------------------------------------------------------- 1. scorers with children


@pytest.mark.parametrize("source", ["mp_process", "mp_pool"])
def test_a_scorer_may_start_processes_with_multiprocessing(pool: RewardPool, source: str) -> None:
    """Daemonic workers could not have children: every such sample scored 0."""
    assert pool.score(source, "abcd", None) == ScoreResult(4.0, {}, None)


# -------------------------------------------------------------------- 2. async scorers


def test_an_async_scorer_is_awaited_on_one_loop_per_worker(pool: RewardPool) -> None:
    """``async def compute_score`` (veRL accepts it) was a bad return: every sample 0."""
    first = pool.score("async", "abc", None)
    assert first.error is None and first.score == 3.0
    again = pool.score("async", "ab", None)
    assert again == ScoreResult(2.0, {"same_loop": 1.0}, None)  # the loop outlives a call


# ------------------------------------------------------ 3. what a scorer starts dies too


def test_what_a_scorer_started_dies_with_its_timeout_and_with_close(
    scorer: Path, tmp_path: Path
) -> None:
    pid_file = tmp_path / "children"
    with RewardPool(num_workers=1, timeout_s=1.0, custom_path=str(scorer)) as pool:
        assert pool.score("child_then_hang", "", str(pid_file)).error == "timeout"
        wait_until(lambda: len(pids_in(pid_file)) == 1, "the scorer's child to start", 5)
        wait_until(lambda: not alive(pids_in(pid_file)[0]), "the timed-out child to die", 5)
        assert pool.score("child_left_behind", "", str(pid_file)) == ScoreResult(1.0, {}, None)
        left = pids_in(pid_file)[1]
        assert alive(left)
    wait_until(lambda: not alive(left), "the child an idle worker left to die at close", 5)


def test_workers_die_with_a_parent_killed_mid_job_even_after_a_respawn(scorer: Path) -> None:
    """A SIGKILLed server (its supervisor's last resort) left workers running their jobs.
    The replacement of a timed-out worker is started by a thread that then ends: it must
    live on (Linux's parent-death signal follows the starting thread, not the process)."""
    done = run_script(
        f"""
        import os, signal, threading, time
        from asyncrl.rewards import RewardPool
        if __name__ == "__main__":
            pool = RewardPool(num_workers=1, timeout_s=0.5, custom_path={str(scorer)!r})
            first = pool._workers[0].process.pid
            assert pool.score("sleep", "30", None).error == "timeout"
            time.sleep(1.5)  # the respawn thread has ended
            assert pool.score("pid", "", None).score != first  # the replacement serves
            worker = pool._workers[0].process.pid
            threading.Thread(target=pool.score, args=("spin", "30", None), daemon=True).start()
            time.sleep(0.3)
            print(worker, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    worker = int(done.stdout.split()[0])
    wait_until(lambda: not alive(worker), "the busy worker to die with its parent", 5)


def test_what_a_scorer_left_running_dies_with_a_killed_server(scorer: Path, tmp_path: Path) -> None:
    """Found by a review: the worker died with a SIGKILLed server, but a process its scorer
    had started and left running lived on (only the pool's kill and close reach the
    worker's group). Each worker's reaper now kills the group when the worker ends."""
    pid_file = tmp_path / "children"
    done = run_script(
        f"""
        import os, signal
        from asyncrl.rewards import RewardPool
        if __name__ == "__main__":
            pool = RewardPool(num_workers=1, timeout_s=5.0, custom_path={str(scorer)!r})
            assert pool.score("child_left_behind", "", {str(pid_file)!r}).score == 1.0
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    (left,) = pids_in(pid_file)
    wait_until(lambda: not alive(left), "the scorer's child to die with the server", 5)


# ------------------------------------------------------------------ 4. stopping a server


def test_the_launchers_group_stop_lets_the_scoring_finish(scorer: Path) -> None:
    """The launcher stops a role with SIGTERM to its process group: the workers were in
    it, died mid-job, and their samples came back worker_died with a warning."""
    done = run_script(
        f"""
        import os, signal, threading, time
        from asyncrl.rewards import RewardPool
        if __name__ == "__main__":
            stop = threading.Event()
            signal.signal(signal.SIGTERM, lambda *a: stop.set())  # the server's handler
            pool = RewardPool(num_workers=2, timeout_s=10, custom_path={str(scorer)!r})
            out = []
            thread = threading.Thread(
                target=lambda: out.extend(pool.score_many([("sleep", "1.0", None)] * 2))
            )
            thread.start()
            time.sleep(0.3)
            os.killpg(os.getpgrp(), signal.SIGTERM)
            thread.join()
            print(stop.is_set(), [(r.score, r.error) for r in out], pool.counters["worker_died"])
            pool.close()
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "True [(1.0, None), (1.0, None)] 0"
    assert "worker_died" not in done.stderr and "died" not in done.stderr


# ------------------------------------------------------------------- 6. a close is quick


def test_a_close_stops_busy_workers_at_once_and_their_calls_raise(
    scorer: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """close() stopped busy workers one at a time (about 1 s each, past the launcher's 15 s
    grace for a dozen); a job it stops is the close's, not the scorer's: no worker_died,
    no warning, no respawn."""
    n = 6
    others = {process.pid for process in multiprocessing.active_children()}
    pool = RewardPool(num_workers=n, timeout_s=60.0, custom_path=str(scorer))
    processes = [worker.process for worker in pool._workers]
    errors: list[BaseException] = []

    def busy() -> None:
        try:
            pool.score("sleep", "100", None)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=busy) for _ in range(n)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    with caplog.at_level(logging.WARNING):
        start = time.monotonic()
        pool.close()
        took = time.monotonic() - start
        for thread in threads:
            thread.join(10)
    assert took < 3.0, f"close() with {n} busy workers took {took:.1f}s"
    assert len(errors) == n and all(type(e) is RuntimeError for e in errors), errors
    assert all("closed" in str(e) for e in errors), errors
    assert pool.counters["worker_died"] == 0 and not caplog.records
    assert not any(process.is_alive() for process in processes)
    time.sleep(0.5)
    assert {p.pid for p in multiprocessing.active_children()} <= others  # none respawned


# -------------------------------------------------------------------- 5. forking scorers


@pytest.mark.parametrize("source", ["fork", "fork_raise"])
def test_a_forked_child_of_a_scorer_never_answers_for_the_worker(
    pool: RewardPool, source: str
) -> None:
    """A fork whose child returned (or raised) into the worker's loop answered on its pipe:
    a later sample got its score, and the child went on reading jobs."""
    worker = pool._workers[0].process.pid
    for text in ("aa", "aaa", "aaaa"):
        assert pool.score(source, text, None) == ScoreResult(float(len(text)), {}, None)
        time.sleep(0.4)  # the child's answer would be waiting by now
    assert live_children(worker) == []  # the reaper (see above) is no child of the worker


def test_a_scorer_that_waits_for_all_its_children_is_not_held_by_the_reaper(
    pool: RewardPool,
) -> None:
    """Found by a review: the reaper was the worker's child and never exited, so a scorer
    that reaps until no child is left (``os.wait()`` until ChildProcessError) hung."""
    assert pool.score("wait_all", "", None) == ScoreResult(1.0, {}, None)


def test_an_answer_that_is_not_the_jobs_is_dropped(pool: RewardPool) -> None:
    for text in ("aa", "aaa"):
        assert pool.score("stale", text, None) == ScoreResult(float(len(text)), {}, None)


# ----------------------------------------------------------- 7. exits and odd exceptions


@pytest.mark.parametrize("source", ["sys_exit", "exit", "unprintable", "unprintable_runtime"])
def test_sys_exit_and_unprintable_exceptions_do_not_end_the_worker(
    pool: RewardPool, source: str, caplog: pytest.LogCaptureFixture
) -> None:
    worker = pool.score("pid", "", None).score
    with caplog.at_level(logging.WARNING):
        assert pool.score(source, "", None) == ScoreResult(0.0, {}, "exception")
    assert pool.score("pid", "", None).score == worker  # the same worker serves on
    said = " ".join(record.getMessage() for record in caplog.records)
    if source == "sys_exit":
        assert "SystemExit(0)" in said
    if source.startswith("unprintable"):  # a review: a RuntimeError's killed the worker
        assert "Unprintable" in said


def test_the_first_failure_of_each_kind_is_logged_however_many_others_came(
    scorer: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a review: the 20 failures logged in full were one budget for every kind,
    so twenty different mistakes of one kind (a model's made-up tool names, a scorer's
    exception types) hid the first timeout or crash for the rest of the run."""
    # A pool of its own: the module's pool has logged other tests' failures already.
    with RewardPool(num_workers=1, timeout_s=10.0, custom_path=str(scorer)) as pool:
        with caplog.at_level(logging.WARNING):
            for i in range(30):
                pool._pool.record("exception", f"Error{i}: raised")
            pool._pool.record("timeout", None)
        counters = dict(pool.counters)
    assert sum("Error" in m for m in caplog.messages) == 20  # still bounded per kind
    assert any("counters['timeout']" in m for m in caplog.messages), caplog.messages[-3:]
    assert counters["exception"] == 30 and counters["timeout"] == 1


IN_ITS_OWN_SESSION = """
import subprocess, sys, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True
    )
    with open(ground_truth, "a") as f:
        f.write(f"{child.pid}\\n")
    time.sleep(300)
"""


def test_what_a_scorer_started_in_a_session_of_its_own_dies_with_its_timeout(
    tmp_path: Path,
) -> None:
    """Found by a review: a code runner starts its program in a session of its own (to
    time it out itself); the worker's group kill at the timeout never reached it, and it
    ran on after the pool closed. The worker's descendants are killed with it."""
    scorer, pid_file = tmp_path / "session.py", tmp_path / "children"
    scorer.write_text(IN_ITS_OWN_SESSION)
    with RewardPool(num_workers=1, timeout_s=1.0, custom_path=str(scorer)) as pool:
        assert pool.score("x", "", str(pid_file)).error == "timeout"
        wait_until(lambda: len(pids_in(pid_file)) == 1, "the scorer's child to start", 5)
        child = pids_in(pid_file)[0]
        try:
            wait_until(lambda: not alive(child), "the child in its own session to die", 5)
        finally:
            if alive(child):
                os.kill(child, signal.SIGKILL)
