"""The learner's acknowledgements of checkpointed batches against a buffer that does not
answer one: rank 0's control plane and the real buffer service on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from learner import control_plane
from tests.standins.rank_zero import validating_rank_zero


class Stop(Exception):
    """Ends a wait for a batch from its keepalive."""


@pytest.mark.timeout(60)
def test_an_acknowledgement_that_got_no_answer_is_sent_again(
    tmp_path: Path, arithmetic_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint's acknowledgement gets no answer (a slow buffer, a lost reply). The
    buffer keeps those batches unacknowledged, and full of them it releases nothing more,
    while the learner waits for the batch that would take it to the next checkpoint. The
    acknowledgement was logged and dropped: a deadlock. It is now sent again, first from
    the wait for the next batch, until the buffer answers."""
    with validating_rank_zero(tmp_path, arithmetic_data) as rig:
        rank0 = rig.rank0
        session = rig.buffer.session
        sent: list[tuple[list[int], Any]] = []
        real_ack = rank0.buffer.ack
        unanswered = [True]

        def ack(batch_ids: list[int], session: Any = None) -> Any:
            sent.append((list(batch_ids), session))
            if unanswered.pop() if unanswered else False:
                raise TimeoutError("no reply within 10s")
            return real_ack(batch_ids, session=session)

        monkeypatch.setattr(rank0.buffer, "ack", ack)
        rank0.acknowledge([(session, 3), (session, 4)])  # the checkpoint's: no answer
        assert sent == [([3, 4], session)]

        monkeypatch.setattr(control_plane, "KEEPALIVE_S", 0.0)

        def keepalive() -> None:
            raise Stop

        with pytest.raises(Stop):
            rank0.wait_batch(0, 0, keepalive=keepalive)
        assert sent == [([3, 4], session), ([3, 4], session)]  # sent again, answered
        rank0.acknowledge([])
        assert len(sent) == 2  # answered once: not sent a third time


@pytest.mark.timeout(60)
def test_a_silent_buffer_is_said_silent_since_the_first_unanswered_request(
    tmp_path: Path, arithmetic_data: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """Found by a hang hunt: the wait's line counted the buffer's silence from the first
    request's timeout, not its send: 22 s said for a buffer silent for 33. Every request
    here goes unanswered, so the buffer has been silent for the whole wait."""
    import re
    import time

    with validating_rank_zero(tmp_path, arithmetic_data) as rig:
        rank0 = rig.rank0

        def silent(*args: Any, **kwargs: Any) -> Any:
            time.sleep(2.0)  # each request waits its reply timeout, then gives up
            raise TimeoutError("no reply")

        monkeypatch.setattr(rank0.buffer, "request_batch", silent)
        monkeypatch.setattr(control_plane, "WAIT_LOG_S", 4.5)
        monkeypatch.setattr(control_plane, "KEEPALIVE_S", 6.5)  # after the line

        def keepalive() -> None:
            raise Stop

        with caplog.at_level("INFO", logger="learner.control_plane"), pytest.raises(Stop):
            rank0.wait_batch(0, 0, keepalive=keepalive)
    (line,) = [r.getMessage() for r in caplog.records if "silent for" in r.getMessage()]
    waited = int(re.search(r"waiting for a batch for (\d+)s", line).group(1))
    silent_s = int(re.search(r"silent for (\d+)s", line).group(1))
    assert waited - silent_s <= 1, line  # it said one 2 s request less


@pytest.mark.timeout(60)
def test_the_batch_the_learner_takes_is_named_to_its_coordinator(
    tmp_path: Path, arithmetic_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffer that restarts while the learner trains a batch does not hold it: the
    coordinator must know the batch is in training, or it deals it again as lost
    (tests/test_reports_across_restarts.py has the coordinator's side)."""
    from types import SimpleNamespace

    with validating_rank_zero(tmp_path, arithmetic_data) as rig:
        rank0 = rig.rank0
        ids = ["train/0/0", "train/0/1"]
        batch = SimpleNamespace(
            batch_id=1,
            session=rig.buffer.session,
            task_ids=ids,
            groups=[SimpleNamespace(task_id=t) for t in ids],
        )
        monkeypatch.setattr(rank0.buffer, "request_batch", lambda *a, **kw: batch)
        assert rank0.wait_batch(0, 0) is batch
        assert rank0.coordinator.in_training() == set(ids)
        rank0.trained(ids)
        assert rank0.coordinator.in_training() == set()
