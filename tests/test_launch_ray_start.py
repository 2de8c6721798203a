"""The start of ``asyncrl-launch --ray`` up to its roles, without a cluster (Ray's calls
replaced by stand-ins):

- ``launch.cpus``, which Ray does not apply, is not checked against the launcher's cores
  (a review's launch under ``taskset -c 1`` was refused: "launch.cpus names core(s) [0]");
- the wait for the run's bundles says every step what they ask for that the cluster
  lacks, and its end names the resource and the config key (a review waited 600 s in
  silence); Ctrl-C and SIGTERM meanwhile end the launch with 130 and 143, the placement
  group removed (a review saw a traceback and -2, and 1 with Ray's crash dump);
- the launcher's W&B, Hugging Face and network variables reach every role, never its
  ``CUDA_VISIBLE_DEVICES`` (a review's learner ran without the W&B key the launcher's
  check had approved).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.exceptions import GetTimeoutError

from asyncrl.config import load_config, run_dir
from asyncrl.launch import ray_main, roles
from asyncrl.launch.local import main
from asyncrl.launch.ray_env import forward_env
from asyncrl.launch.ray_plan import Placement
from asyncrl.launch.ray_reserve import Stopped, reserve, shortfall
from asyncrl.launch.role_state import Role
from tests.helpers import launch_inputs

pytestmark = pytest.mark.timeout(60)

# The module (``ray.util.placement_group`` as an attribute is the function of that name).
ray_pg = importlib.import_module("ray.util.placement_group")

# Bundle 0 (buffer, learner) and one rollout server's bundle asking for a resource no
# node has, as `launch.ray.resources={rollout: {nope: 1}}` makes it.
PLACEMENT = Placement(
    [{"CPU": 1.0}, {"CPU": 1.0, "nope": 1.0}],
    {"buffer": 0, "learner": 0, "rollout-0": 1},
    {"buffer": 0.0, "learner": 0.0, "rollout-0": 0.0},
)


@pytest.fixture
def inputs(tmp_path) -> list[str]:
    return launch_inputs(tmp_path)


# ---------------------------------------------------------------- launch.cpus under Ray


def test_a_ray_launch_does_not_check_launch_cpus_against_this_machine(inputs, monkeypatch, capsys):
    absent = max(os.sched_getaffinity(0)) + 1000  # no core of this machine
    cpus = f"launch.cpus={{learner: [{absent}], rollout: [[{absent}], [{absent}]], buffer: [0]}}"
    seen = []
    monkeypatch.setattr(ray_main, "main_ray", lambda cfg: seen.append(cfg) or 7)
    assert main([*inputs, cpus, "--ray"]) == 7  # Ray drops the pins: nothing to refuse
    assert len(seen) == 1
    assert main([*inputs, cpus]) == 2  # the local launcher pins its roles with them
    assert f"launch.cpus names core(s) [{absent}]" in capsys.readouterr().err
    assert len(seen) == 1


# ---------------------------------------------------------------- waiting for bundles


class _Ray:
    """Stand-ins for the Ray calls of a reservation that never completes; ``on_get`` runs
    in each ``ray.get`` (to send a signal)."""

    def __init__(self, monkeypatch, on_get=None):
        self.removed: list[Any] = []
        self.gets = 0
        pg = SimpleNamespace(ready=lambda: "ready-ref")

        def get(ref: Any, timeout: float | None = None) -> Any:
            self.gets += 1
            if on_get is not None:
                on_get()
            time.sleep(timeout or 0)
            raise GetTimeoutError("not placed")

        monkeypatch.setattr(ray_pg, "placement_group", lambda bundles, strategy: pg)
        monkeypatch.setattr(ray_pg, "remove_placement_group", self.removed.append)
        monkeypatch.setattr(ray, "get", get)
        monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 2.0})
        monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
        node = {"Alive": True, "Resources": {"CPU": 4.0}}
        monkeypatch.setattr(ray, "nodes", lambda: [node])
        self.pg = pg


def test_the_wait_for_bundles_says_what_is_missing_and_ends_naming_the_key(monkeypatch, caplog):
    caplog.set_level(logging.INFO, "asyncrl.launch")
    fake = _Ray(monkeypatch)
    assert reserve(PLACEMENT, "PACK", 0.5, step_s=0.1) is None
    missing = (
        "nope: the bundles ask for 1, the cluster has 0 (0 free); set by "
        "launch.ray.resources.rollout.nope"
    )
    waits = [m for m in caplog.messages if m.startswith("waiting ")]
    assert len(waits) >= 3, caplog.messages
    assert all(f"(missing: {missing})" in m for m in waits), waits
    assert "for bundles [{'CPU': 1.0}, {'CPU': 1.0, 'nope': 1.0}]" in waits[0]
    last = caplog.messages[-1]
    assert last.startswith("the cluster cannot hold the run's bundles after 0s: ")
    assert missing in last
    assert fake.removed == [fake.pg]  # nothing stays reserved


def test_the_missing_resources_name_their_config_keys():
    cuda = Placement(
        [{"CPU": 4.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}],
        {"buffer": 0, "learner": 0, "rollout-0": 1},
        {},
    )
    (no_gpu,) = shortfall(cuda, {"CPU": 8.0}, {"CPU": 8.0})
    assert no_gpu == (
        "GPU: the bundles ask for 3, the cluster has 0 (0 free); set by trainer.nproc / "
        "rollout.tensor_model_parallel_size (or trainer.device=cpu)"
    )
    (busy,) = shortfall(cuda, {"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 4.0})
    assert busy.startswith("GPU: the bundles ask for 3, the cluster has 4 (1 free)")
    # Enough in all, but no node holds bundle 0 alone.
    nodes = [{"CPU": 2.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 2.0}]
    free = {"CPU": 8.0, "GPU": 4.0}
    (line,) = shortfall(cuda, free, free, nodes)
    assert line.startswith("bundle 0 {'CPU': 4.0, 'GPU': 2.0}: no single node has that much")
    assert "launch.ray.learner_cpus" in line


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_waiting_for_bundles_removes_them_and_exits_as_the_shell_says(
    signum, code, monkeypatch
):
    fake = _Ray(monkeypatch, on_get=lambda: os.kill(os.getpid(), signum))
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(Stopped) as stopped:
        reserve(PLACEMENT, "PACK", 30, step_s=1.0)
    assert stopped.value.code == code
    assert fake.removed == [fake.pg] and fake.gets == 1
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def _stand_in_ray_launch(monkeypatch) -> None:
    """main_ray without joining Ray."""
    monkeypatch.setattr(ray_main, "connect", lambda address: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)


def test_a_ray_launch_sent_sigterm_while_waiting_for_bundles_exits_143(inputs, monkeypatch):
    _stand_in_ray_launch(monkeypatch)
    fake = _Ray(monkeypatch, on_get=lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert ray_main.main_ray(load_config(inputs[0], inputs[1:])) == 143
    assert fake.removed == [fake.pg]


# ---------------------------------------------------------------- the launcher's environment


class _Supervisor:
    """Stand-in RaySupervisor: bundle 0's node is this machine."""

    def __init__(self, names: list[Role], *args: Any):
        self.roles = names

    def agent(self, name: str) -> str:
        return name

    def _call(self, agent: str, method: str, timeout_s: float) -> dict[str, str]:
        return {"ip": "127.0.0.1"}


def test_every_ray_role_gets_the_launchers_wandb_hf_and_network_variables(inputs, monkeypatch):
    _stand_in_ray_launch(monkeypatch)
    monkeypatch.setattr(ray_main, "reserve", lambda placement, strategy, timeout_s: "pg")
    monkeypatch.setattr(ray_main, "RaySupervisor", _Supervisor)
    monkeypatch.setattr(ray_main, "Departures", SimpleNamespace(from_config=lambda cfg: None))
    started: dict[str, dict[str, str]] = {}

    def drive(sup: Any, run_dir: Path, cfg: Any) -> int:
        started.update({r.name: r.env for r in sup.roles})
        return 0

    monkeypatch.setattr(roles, "drive", drive)
    launcher = {
        "WANDB_API_KEY": "secret-wandb-key",
        "WANDB_MODE": "online",
        "HF_HOME": "/models/hf",
        "HF_TOKEN": "secret-hf-token",
        "TRANSFORMERS_OFFLINE": "1",
        "NCCL_SOCKET_IFNAME": "eth9",
        "GLOO_SOCKET_IFNAME": "eth9",
    }
    for k, v in launcher.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    cfg = load_config(inputs[0], inputs[1:])
    assert ray_main.main_ray(cfg) == 0
    assert sorted(started) == ["buffer", "learner", "rollout-0", "rollout-1"]
    for name, env in started.items():
        assert {k: env.get(k) for k in launcher} == launcher, name
        assert "CUDA_VISIBLE_DEVICES" not in env and "UNRELATED_SETTING" not in env, name
    commands = (run_dir(cfg) / "commands.txt").read_text()
    assert "secret" not in commands  # the keys stay out of the run directory


def test_a_roles_own_variables_win_over_the_launchers_and_devices_are_never_forwarded():
    role = Role("rollout-0", ["x"], env={"HF_HOME": "/mine", "CUDA_VISIBLE_DEVICES": "1"})
    names = forward_env(
        [role], {"HF_HOME": "/launcher", "NCCL_IB_HCA": "mlx5", "CUDA_VISIBLE_DEVICES": "0"}
    )
    assert names == ["HF_HOME", "NCCL_IB_HCA"]
    assert role.env == {"HF_HOME": "/mine", "CUDA_VISIBLE_DEVICES": "1", "NCCL_IB_HCA": "mlx5"}
