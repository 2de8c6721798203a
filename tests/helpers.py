"""Small helpers every test may use: free ports, waiting on a condition, process liveness,
learner ranks started as torchrun starts them, and a learner check of sampled rollouts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest

from asyncrl.net import ports as net_ports

T = TypeVar("T")

ENDPOINTS = ("tasks", "trajectories", "batches", "control", "sync_store")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` different ports free right now on ``host``, from outside the kernel's ephemeral
    range, so that no outgoing connection is given one before a role binds it."""
    return net_ports.free_ports(host, n)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host``."""
    return free_ports(1, host)[0]


def endpoint_overrides() -> list[str]:
    """Config overrides that put every endpoint of a run on its own free port."""
    ports = free_ports(len(ENDPOINTS))
    return [f"endpoints.{name}={port}" for name, port in zip(ENDPOINTS, ports, strict=True)]


def wait_until(
    pred: Callable[[], T],
    what: str,
    timeout_s: float = 30.0,
    *,
    every_s: float = 0.05,
    details: Callable[[], object] | None = None,
) -> T:
    """Call ``pred`` every ``every_s`` seconds until it returns something true, and return
    that. After ``timeout_s`` fail the test, naming ``what`` (and adding ``details()``, e.g.
    the tails of the logs). ``pred`` may itself fail the test (a process that died)."""
    deadline = time.monotonic() + timeout_s
    while not (value := pred()):
        if time.monotonic() > deadline:
            extra = f"\n{details()}" if details is not None else ""
            pytest.fail(f"timed out after {timeout_s:g}s waiting for {what}{extra}")
        time.sleep(every_s)
    return value


async def wait_until_async(
    pred: Callable[[], T], what: str, timeout_s: float = 30.0, *, every_s: float = 0.005
) -> T:
    """:func:`wait_until` inside an event loop: awaits between the calls of ``pred``, so the
    tasks it waits for keep running."""
    deadline = time.monotonic() + timeout_s
    while not (value := pred()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(every_s)
    return value


def log_tails(directory: Path, chars: int = 2000) -> str:
    """The last ``chars`` characters of every ``*.log`` in ``directory``, for messages."""
    logs = sorted(Path(directory).glob("*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has exited for our purpose)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class LoopThread:
    """An asyncio loop in a thread: an engine lives on it, the test drives it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def kill_session(proc) -> None:
    """SIGKILL a process started with ``start_new_session=True`` and everything in its
    session (a rollout server's vLLM engine processes), then reap it."""
    import os
    import signal

    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait(30)


def check_on_policy_and_trains(rollouts, model_path, max_prompt: int, max_response: int) -> None:
    """A fresh learner on ``model_path`` (the weights that sampled ``rollouts``) gives the
    behaviour logprobs back on every sampled token (1e-4), and one step on them trains."""
    import math

    import torch

    from asyncrl.config import load_config
    from learner.trainer import Trainer

    cfg = load_config(
        None,
        [
            f"model.path={model_path}",
            f"data.max_prompt_length={max_prompt}",
            f"data.max_response_length={max_response}",
        ],
    )
    trainer = Trainer(cfg)
    for r, lp in zip(rollouts, trainer.compute_logprobs(rollouts, 1.0), strict=True):
        assert lp is not None
        mask = torch.tensor(r.loss_mask if r.loss_mask is not None else [1] * len(lp)).bool()
        gap = (lp[mask] - torch.tensor(r.behaviour_logprobs)[mask]).abs().max()
        assert gap < 1e-4, gap
    metrics = trainer.train_step(rollouts, 1.0)
    assert metrics["batch/dropped_length_mismatch"] == 0
    assert math.isfinite(metrics["loss/total"]) and metrics["actor/grad_norm"] > 0


def rank_env(rank: int, world: int, port: int) -> None:
    """This process is ``rank`` of ``world`` learner ranks meeting on 127.0.0.1:``port``,
    as torchrun would say it in the environment."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )


def start_ranks(worker: Callable[..., None], world: int, *args: Any):
    """Start ``worker(rank, world, *args)`` in ``world`` spawned processes without waiting
    (the test computes the one-rank side meanwhile); :func:`join_ranks` waits for them."""
    import torch.multiprocessing as mp

    return mp.start_processes(
        worker, args=(world, *args), nprocs=world, join=False, start_method="spawn"
    )


def leave_ranks() -> NoReturn:
    """End a spawned learner rank once every rank is here, without torch's teardown.

    Call it after the rank has written its results: the barrier makes every rank past each
    collective of its own, and ``os._exit`` skips ``destroy_process_group``, whose gloo
    teardown aborted a rank leaving a moment after the other (SIGABRT, "terminate called
    without an active exception": once in a fresh-clone run, once in five of a harness)."""
    import torch.distributed as dist

    dist.barrier()
    os._exit(0)


def join_ranks(ctx) -> None:
    """Wait for ranks started by :func:`start_ranks` (raises if one failed)."""
    while not ctx.join(timeout=1):
        pass


def start_coordinator(
    n_rows: int, per_version: int, group_filter: Any = None, settings: Any = None
) -> Any:
    """A started coordinator on OS-chosen loopback ports over ``n_rows`` arithmetic rows
    (groups of 2, policy lag 1, ``per_version`` groups per version; ``group_filter``: a
    :class:`~asyncrl.control.group_filter.GroupFilter`; ``settings``: the learner's shared
    settings, :mod:`asyncrl.config.shared`); stop it when done."""
    from asyncrl.control import Budget, ControlState, Coordinator, TaskSource
    from asyncrl.control.ledger import TaskLedger
    from asyncrl.control.syncs import SyncBook
    from asyncrl.tasks import make_row

    rows = [
        make_row("arithmetic", f"{i}+1=", str(i + 1), split="train", index=i) for i in range(n_rows)
    ]
    state = ControlState(
        TaskLedger(TaskSource(rows, n=2), Budget(1, per_version)),
        SyncBook(),
        heartbeat_s=1.0,
        dead_after_s=60.0,
        store_host="127.0.0.1",
        store_port=0,
        group_filter=group_filter,
    )
    state.settings = dict(settings or {})
    coord = Coordinator(state, tasks_addr="tcp://127.0.0.1:*", control_addr="tcp://127.0.0.1:*")
    return coord.start()


def launch_inputs(tmp_path: Path) -> list[str]:
    """The demo config over a stand-in model folder and a few rows of data: it passes the
    launcher's checks (for tests whose roles never start)."""
    from asyncrl.tasks import prepare_task_data

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    prepare_task_data("arithmetic", tmp_path / "data", seed=0, n_train=8, n_val=2)
    return [
        "configs/cpu_demo.yaml",
        f"model.path={tmp_path}/model",
        f"data.train_files={tmp_path}/data/train.parquet",
        f"data.val_files={tmp_path}/data/val.parquet",
        f"trainer.default_local_dir={tmp_path}",
        "launch.cpus=null",
    ]


def write_config(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    """A config file of ``text`` in ``tmp_path``."""
    path = tmp_path / name
    path.write_text(text)
    return path


def config_problems(path: Path | str | None, overrides: Any = ()) -> list[str]:
    """The problems :func:`asyncrl.config.load_config` refuses ``path`` and ``overrides``
    with (the test fails if it loads them)."""
    from asyncrl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.problems
