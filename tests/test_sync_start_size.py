"""A weight sync's announcement within ``control.max_message_mb``: a real Coordinator and a
real CoordinatorClient on 127.0.0.1, both built from one config.

A sync's :class:`~asyncrl.control.messages.SyncStart` lists every tensor the push carries
(name, shape, offset). A server's control socket drops a reply over the bound unread, so an
announcement past it was never heard: the server gave the coordinator up as silent,
restarted, and was sent the same catch-up again, while the learner's syncs timed out. The
learner now builds its plan at start and stops there, with one line naming the value that
fits, and a value that fits does carry the announcement to the server.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from asyncrl.control import Coordinator, coordinator_from_config
from asyncrl.control import messages as m
from asyncrl.control.client import CoordinatorClient
from asyncrl.launch.restart_policy import CONFIG_ERROR
from asyncrl.net.transport import mebibytes
from asyncrl.sync.plan import plan_buckets, specs_of
from asyncrl.sync.sender import WeightPusher
from asyncrl.tasks import prepare_task_data
from tests.standins.learner import loopback_config, spawn_buffer

BASE = ["control.heartbeat_s=0.2", "control.dead_after_s=30"]


def _experts(n: int) -> dict[str, torch.Tensor]:
    """``n`` small tensors named as a mixture of experts names its expert matrices."""
    return {
        f"model.layers.{i // 384}.mlp.experts.{i % 384}.down_proj.weight": torch.zeros(2, 3)
        for i in range(n)
    }


def _pusher(coord: Coordinator, mb: float) -> WeightPusher:
    """The learner's pusher of ``coord``'s rounds, announcing under ``mb`` MiB."""
    return WeightPusher(
        coord,
        None,
        backend="gloo",
        timeout_s=5.0,
        bucket_bytes=1 << 20,
        max_message_bytes=mebibytes(mb),
    )


def _suggested_mb(err: pytest.ExceptionInfo[ValueError]) -> float:
    found = re.search(r"set control\.max_message_mb=([0-9.]+) or more", str(err.value))
    assert found, str(err.value)
    return float(found.group(1))


def test_an_announcement_over_the_bound_names_a_value_that_fits():
    """4,000 tensors take about 0.25 MiB to announce: refused under 0.1 MiB with the count,
    the size and a value that fits; accepted under that value."""
    plan = plan_buckets(specs_of(_experts(4000)), 1 << 20)
    with pytest.raises(ValueError, match=r"weight sync of 4000 tensors") as err:
        m.check_sync_start(plan, mebibytes(0.1))
    assert "control.max_message_mb=0.1 allows" in str(err.value)
    size = m.check_sync_start(plan, mebibytes(_suggested_mb(err)))
    assert 0.1 * 2**20 < size < mebibytes(_suggested_mb(err))


@pytest.mark.timeout(60)
def test_the_pusher_refuses_a_plan_before_any_round_and_a_fitting_one_reaches_the_server(
    tmp_path,
):
    """Under a bound too small, building the plan raises and the coordinator's version does
    not move (no round began). Under the suggested bound, the announcement of a real round
    reaches a registered server, which reads it within that same bound."""
    tensors = _experts(4000)
    small = 0.1
    cfg, _ = loopback_config(tmp_path, [*BASE, f"control.max_message_mb={small}"])
    with coordinator_from_config(cfg, train_rows=[], val_rows=[], buffer=False) as coord:
        pusher = _pusher(coord, small)
        with pytest.raises(ValueError, match="control.max_message_mb") as err:
            pusher.plan_for(tensors)
        assert pusher.plan is None and coord.version == 0

    fits = _suggested_mb(err)
    cfg, _ = loopback_config(tmp_path, [*BASE, f"control.max_message_mb={fits}"])
    with coordinator_from_config(cfg, train_rows=[], val_rows=[], buffer=False) as coord:
        pusher = _pusher(coord, fits)
        plan = pusher.plan_for(tensors)
        client = CoordinatorClient.from_config(cfg, "rollout-0", engine_world_size=1)
        try:
            client.register()
            rnd = coord.begin_sync(plan)
            assert rnd.members == ["rollout-0"]
            for _ in range(20):  # the announcement comes with the next heartbeat or two
                ann = client.heartbeat(0.2)
                if ann is not None and ann.sync is not None:
                    break
            else:
                pytest.fail("the sync was never announced to the server")
            assert ann.sync.plan == plan
        finally:
            client.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_learner_stops_at_start_when_its_syncs_could_not_be_announced(tmp_path, tiny_model):
    """The tiny model's plan announced under a bound it does not fit: the learner exits
    before its first step with a config error (which the launcher does not restart), in
    one line that says which value fits."""
    prepare_task_data("arithmetic", tmp_path / "data", seed=0)
    _, config = loopback_config(
        tmp_path,
        [
            *BASE,
            f"model.path={tiny_model}",
            f"data.train_files={tmp_path}/data/train.parquet",
            f"data.val_files={tmp_path}/data/val.parquet",
            "trainer.val_before_train=false",
            "trainer.logger=[jsonl]",
            "control.max_message_mb=0.0015",  # its plan takes about 2 KiB to announce
        ],
    )
    log = tmp_path / "learner.log"
    buffer = spawn_buffer(config, tmp_path / "buffer.log")
    try:
        with open(log, "w") as out:
            learner = subprocess.run(
                [sys.executable, "-m", "learner.main", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=240,
            )
        text = log.read_text()
        assert learner.returncode == CONFIG_ERROR, text[-3000:]  # the launcher won't restart it
        line = re.search(r"cannot start: announcing a weight sync of \d+ tensors.*", text)
        assert line and "set control.max_message_mb=0.1 or more" in line.group(0), text[-3000:]
        assert "Traceback" not in text and "step 1" not in text
    finally:
        if buffer.poll() is None:
            buffer.kill()
