"""Weight sync between a reference sender (this process) and stand-in receivers (real
processes, real gloo groups over a TCPStore on 127.0.0.1)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncrl.sync.groups import WeightSyncError, form_group, open_store
from asyncrl.sync.plan import Bucket, TensorSpec, plan_buckets, specs_of
from asyncrl.sync.weights import send_weights
from rollout_servers.worker_ext import RELOAD_LOGGER, ExpectedReloadGaps
from tests.helpers import free_port
from tests.standins.weights import StandInReceiver

TIMEOUT = 5.0


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=g),
        "layer.0.norm": torch.randn(64, generator=g).bfloat16(),
        "layer.0.proj": torch.randn(64, 256, generator=g),
        "layer.1.proj": torch.randn(64, 256, generator=g).bfloat16(),
        "head.bias": torch.randn(7, generator=g),
    }


def _sync(store, receivers, generation, tensors, bucket_bytes=16 * 1024, group=None):
    """Run one sync: receivers join ``generation`` as ranks 1..n; returns (group, results)."""
    plan = plan_buckets(specs_of(tensors), bucket_bytes)
    for rank, r in enumerate(receivers, start=1):
        r.start_sync(generation, rank, len(receivers) + 1, plan)
    if group is None:
        group = form_group(store, generation, 0, len(receivers) + 1, timeout_s=TIMEOUT)
    send_weights(group, tensors, plan, timeout_s=TIMEOUT)
    return group, [r.result(TIMEOUT * 3) for r in receivers]


def _assert_bit_exact(sent, result):
    status, received = result
    assert status == "ok", received
    assert set(received) == set(sent)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype, name
        # Compare the bytes: equal values are not enough (NaN payloads, -0.0).
        assert torch.equal(received[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_plan_buckets_is_dtype_grouped_and_bounded():
    specs = [
        TensorSpec("a", (10,), "float32"),
        TensorSpec("b", (4,), "bfloat16"),
        TensorSpec("c", (20,), "float32"),
        TensorSpec("big", (100,), "float32"),
        TensorSpec("d", (2,), "float32"),
    ]
    plan = plan_buckets(specs, bucket_bytes=120)  # 30 float32 elements per bucket
    buckets = plan.buckets
    assert [b.dtype for b in buckets] == ["float32", "float32", "float32", "bfloat16"]
    assert [[e.name for e in b.entries] for b in buckets] == [["a", "c"], ["big"], ["d"], ["b"]]
    assert [(e.offset, e.numel) for e in buckets[0].entries] == [(0, 10), (10, 20)]
    assert all(b.nbytes <= 120 or len(b.entries) == 1 for b in buckets)
    assert plan.nbytes == 4 * (10 + 20 + 100 + 2) + 2 * 4
    assert isinstance(buckets[0], Bucket)
    with pytest.raises(ValueError, match="cannot be synced"):
        plan_buckets([TensorSpec("x", (1,), "complex64")], 100)


def test_sync_lifecycle_failure_regroup_and_late_join():
    port = free_port()
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=TIMEOUT)
    a = StandInReceiver("127.0.0.1", port, timeout_s=TIMEOUT)
    b = StandInReceiver("127.0.0.1", port, timeout_s=TIMEOUT)
    late = None
    try:
        # 1. Two receivers get fp32 and bf16 tensors bit for bit; the group is reused.
        v1 = _weights(1)
        group, results = _sync(store, [a, b], "gen1", v1)
        for result in results:
            _assert_bit_exact(v1, result)
        v2 = _weights(2)
        group, results = _sync(store, [a, b], "gen1", v2, group=group)
        for result in results:
            _assert_bit_exact(v2, result)

        # 2. A receiver dies: the sender raises within the timeout instead of hanging.
        b.kill()
        plan = plan_buckets(specs_of(v2), 16 * 1024)
        a.start_sync("gen1", 1, 3, plan)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="drop it and form a new group"):
            send_weights(group, _weights(3), plan, timeout_s=TIMEOUT)
        # Within the collective's timeout, not hanging: the margin is for a loaded machine.
        assert time.monotonic() - start < TIMEOUT + 5
        assert a.result(TIMEOUT * 3)[0] == "error"  # the survivor's collective fails too

        # 3. The next sync re-forms the group (new generation) without the dead member.
        v4 = _weights(4)
        group, (result,) = _sync(store, [a], "gen2", v4)
        _assert_bit_exact(v4, result)

        # 4. A receiver started late catches up through a one-off group with the sender,
        #    then joins the main group at the next sync.
        late = StandInReceiver("127.0.0.1", port, timeout_s=TIMEOUT)
        _, (caught_up,) = _sync(store, [late], "catchup/late/1", v4)
        _assert_bit_exact(v4, caught_up)
        v5 = _weights(5)
        group, results = _sync(store, [a, late], "gen3", v5)
        for result in results:
            _assert_bit_exact(v5, result)
    finally:
        for r in (a, b, late):
            if r is not None:
                r.close()


def test_forming_a_group_with_a_missing_member_times_out():
    port = free_port()
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=2)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"could not connect.*rank\(s\) \[1\] never joined"):
        form_group(store, "lonely", 0, 2, timeout_s=2)
    assert time.monotonic() - start < 2 + 6  # the 2 s timeout, with a loaded machine's margin


def test_a_member_that_gave_up_is_not_counted_by_one_that_comes_late():
    """A member that timed out gives the meeting up: one arriving after it must not pass
    the meeting and then wait for it in the first collective (under NCCL, without a
    bound). It fails at once, on the give-up."""
    port = free_port()
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=2)
    with pytest.raises(WeightSyncError, match=r"rank\(s\) \[1\] never joined"):
        form_group(store, "late", 0, 2, timeout_s=1)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"not formed .*rank 0 gave up"):
        form_group(store, "late", 1, 2, timeout_s=5)
    assert time.monotonic() - start < 2


def _meeting_with_rank_1_waiting(timeout_s: float) -> tuple[object, threading.Thread, list[str]]:
    """A store hosted here for a meeting of 3, and rank 1 waiting in it on a thread for up
    to ``timeout_s``; the errors it stops with are appended to the list returned."""
    port = free_port()
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=2)
    member = open_store("127.0.0.1", port, is_host=False, timeout_s=2)
    errors: list[str] = []

    def rank_1() -> None:
        try:
            form_group(member, "g", 1, 3, timeout_s=timeout_s)
        except WeightSyncError as e:
            errors.append(str(e))

    waiting = threading.Thread(target=rank_1, daemon=True)
    waiting.start()
    return store, waiting, errors


def test_a_member_waiting_when_another_gives_up_is_told_who_never_joined():
    """Rank 0 gives up on rank 2; rank 1, still waiting, stops with it and names rank 2
    alone. Rank 0 used to take its own flag back as it gave up, so that a member looking
    just after counted rank 0 among those that never joined."""
    store, waiting, errors = _meeting_with_rank_1_waiting(timeout_s=10)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"rank\(s\) \[2\] never joined"):
        form_group(store, "g", 0, 3, timeout_s=1)
    waiting.join(5)
    assert time.monotonic() - start < 4  # not rank 1's own 10 s
    (error,) = errors
    assert "rank 0 gave up" in error and "rank(s) [2] never joined" in error


def test_a_meeting_the_learner_abandons_stops_every_member_at_once():
    """The coordinator lost a member before the group formed: the learner gives the
    meeting up (``abandon``), and the members that came stop with it, well before their
    timeout."""
    store, waiting, errors = _meeting_with_rank_1_waiting(timeout_s=30)
    lost = threading.Timer(0.5, lambda: reasons.append("c was lost"))
    reasons: list[str] = []
    lost.start()
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="rank 0 abandoned it: c was lost"):
        form_group(store, "g", 0, 3, timeout_s=30, abandon=lambda: "".join(reasons))
    waiting.join(5)
    assert time.monotonic() - start < 3
    assert len(errors) == 1 and "rank 0 abandoned it: c was lost" in errors[0]


def test_joining_a_store_nobody_hosts_fails_clearly():
    with pytest.raises(WeightSyncError, match="check endpoints.host"):
        open_store("127.0.0.1", free_port(), is_host=False, timeout_s=1)


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as the kernel lists them) of sockets listening at ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
def test_the_sync_store_listens_at_the_configured_host_only():
    """torch's store server listens on every interface; the run's listens where
    ``endpoints.host`` says, as its other ports do (a review read ``*:PORT`` with
    ``endpoints.host=127.0.0.1``). A second host at the same port fails in one line."""
    port = free_port()
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=5)
    assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, nothing wider
    joined = open_store("127.0.0.1", port, is_host=False, timeout_s=5)
    joined.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(WeightSyncError, match="cannot host the sync store"):
        open_store("127.0.0.1", port, is_host=True, timeout_s=1)


def test_hf_model_receiver_loads_pushed_weights(tiny_model):
    """The stand-in receiver holding an HF model ends with exactly the sender's weights."""
    from transformers import AutoModelForCausalLM

    port = free_port()
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=30)
    sender = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        for p in sender.parameters():
            p.add_(0.01)  # materially different from what the receiver loaded
    tensors = {n: t.detach() for n, t in sender.state_dict().items()}
    receiver = StandInReceiver("127.0.0.1", port, model_dir=str(tiny_model), timeout_s=30)
    try:
        _, (result,) = _sync(store, [receiver], "hf1", tensors, bucket_bytes=1 << 20)
        _assert_bit_exact(tensors, result)
    finally:
        receiver.close()


def test_a_push_packs_where_its_backend_broadcasts_from():
    """NCCL broadcasts only CUDA tensors: a learner pushing over NCCL packs on its CUDA
    device (this was missed once: CPU buffers would fail the first GPU push)."""
    from asyncrl.sync.sender import WeightPusher, pack_device

    assert pack_device("nccl") == "cuda" and pack_device("gloo") == "cpu"
    pusher = WeightPusher(None, None, backend="nccl", timeout_s=1, bucket_bytes=1)  # type: ignore[arg-type]
    assert pusher.device == "cuda"


class _Rounds:
    """The coordinator's side of a round, recorded: what the pusher told it, in order."""

    sync_secret = ""  # the group's store keys are its generation's name

    def __init__(self) -> None:
        self.calls: list[str] = []

    def weights_sent(self, rnd) -> None:
        self.calls.append("weights_sent")

    def finish_sync(self, rnd, sent_ok: bool = True, error: str = "") -> None:
        self.calls.append(f"finish_sync ok={sent_ok}")


@pytest.mark.parametrize("deal_at_send", [True, False])
def test_the_window_moves_at_the_send_only_with_deal_at_send(deal_at_send):
    """``staleness.deal_at_send``: once the broadcast has ended, and before the round is
    closed, the pusher tells the coordinator (which opens the admission window then);
    without it the window waits for the round's close, as it always did."""
    from asyncrl.control.syncs import SyncRound
    from asyncrl.sync.sender import WeightPusher

    port = free_port()
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=TIMEOUT)
    a = StandInReceiver("127.0.0.1", port, timeout_s=TIMEOUT)
    try:
        rounds = _Rounds()
        pusher = WeightPusher(
            rounds,  # type: ignore[arg-type]
            store,
            backend="gloo",
            timeout_s=TIMEOUT,
            bucket_bytes=16 * 1024,
            deal_at_send=deal_at_send,
        )
        v1 = _weights(1)
        a.start_sync("gen1", 1, 2, pusher.plan_for(v1))
        rnd = SyncRound(1, 1, "gen1", 2, {"a": 1}, new_group=True, catchup=False)
        pusher.complete(rnd, v1)
        _assert_bit_exact(v1, a.result(TIMEOUT * 3))
        sent = ["weights_sent"] if deal_at_send else []
        assert rounds.calls == [*sent, "finish_sync ok=True"]
    finally:
        a.close()


def _reload_record(layer: str) -> logging.LogRecord:
    return logging.LogRecord(
        RELOAD_LOGGER, logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None
    )


@pytest.mark.parametrize(
    ("layer", "tied", "heard"),
    [
        ("RotaryEmbedding", False, False),  # its cache is computed, never pushed
        ("ParallelLMHead", True, False),  # re-tied to the new embedding after the load
        ("ParallelLMHead", False, True),  # an untied head that missed its weights
        ("QKVParallelLinear", True, True),  # any other layer
    ],
)
def test_only_the_reload_gaps_a_push_has_by_design_are_silenced(layer, tied, heard):
    gaps = ExpectedReloadGaps()
    gaps.tied = tied
    assert gaps.filter(_reload_record(layer)) is heard
    other = logging.LogRecord(
        RELOAD_LOGGER, logging.WARNING, __file__, 1, "%s: other", (layer,), None
    )
    assert gaps.filter(other)


def test_a_tensor_on_the_current_gpu_travels_as_itself(monkeypatch):
    """The push packs for device "cuda" (the current one); a tensor reports "cuda:0", and
    torch.device("cuda:0") != torch.device("cuda"): every large tensor was copied into a
    send buffer kept for the life of the process, never sent as itself."""
    from asyncrl.sync.weights import on_device

    assert torch.device("cuda", 0) != torch.device("cuda")  # why a plain == was wrong
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert on_device(torch.device("cuda", 0), "cuda")
    assert not on_device(torch.device("cuda", 1), "cuda")
    assert on_device(torch.device("cuda", 1), "cuda:1")
    assert on_device(torch.device("cpu"), "cpu") and not on_device(torch.device("cpu"), "cuda")


def test_a_broadcast_that_cannot_start_is_the_groups_failure_not_the_processes():
    """NCCL forms its communicator at the first collective: a member that is gone or shares
    a GPU fails the broadcast call itself, which was raised as it came and ended the
    learner instead of dropping the group (the pusher handles WeightSyncError)."""
    from asyncrl.sync.weights import send_weights

    class NoStart:
        def broadcast(self, *args, **kwargs):
            raise torch.distributed.DistBackendError("NCCL error: Duplicate GPU detected")

    plan = plan_buckets(specs_of(_weights(0)), 1 << 16)
    with pytest.raises(WeightSyncError, match="could not start .*Duplicate GPU detected"):
        send_weights(NoStart(), _weights(0), plan, timeout_s=1.0)


def test_a_failed_push_aborts_its_group_and_the_next_round_forms_a_new_one(monkeypatch):
    """A push whose member died aborts its group (under NCCL a group only dropped keeps
    its broadcast posted until the watchdog, which may end the process); the survivor's
    receive fails, and the next generation forms without the dead member."""
    from asyncrl.control.syncs import SyncRound
    from asyncrl.sync import sender

    aborted: list[str] = []
    real_form = sender.form_group

    class Recorded:  # a real gloo group whose abort is recorded
        def __init__(self, pg, generation: str) -> None:
            self.pg, self.generation = pg, generation

        def __getattr__(self, name: str):
            return getattr(self.pg, name)

        def abort(self) -> None:
            aborted.append(self.generation)
            self.pg.abort()

    monkeypatch.setattr(
        sender,
        "form_group",
        lambda store, gen, *a, **k: Recorded(real_form(store, gen, *a, **k), gen),
    )
    port = free_port()
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=TIMEOUT)
    a = StandInReceiver("127.0.0.1", port, timeout_s=TIMEOUT)
    b = StandInReceiver("127.0.0.1", port, timeout_s=TIMEOUT)
    try:
        rounds = _Rounds()
        pusher = sender.WeightPusher(
            rounds,  # type: ignore[arg-type]
            store,
            backend="gloo",
            timeout_s=TIMEOUT,
            bucket_bytes=16 * 1024,
        )
        v1 = _weights(1)
        plan = pusher.plan_for(v1)
        a.start_sync("gen1", 1, 3, plan)
        b.start_sync("gen1", 2, 3, plan)
        pusher.complete(SyncRound(1, 1, "gen1", 3, {"a": 1, "b": 2}, True, False), v1)
        for receiver in (a, b):
            _assert_bit_exact(v1, receiver.result(TIMEOUT * 3))
        assert aborted == [] and rounds.calls == ["finish_sync ok=True"]

        b.kill()
        a.start_sync("gen1", 1, 3, plan)
        pusher.complete(SyncRound(2, 2, "gen1", 3, {"a": 1, "b": 2}, False, False), _weights(2))
        assert rounds.calls[-1] == "finish_sync ok=False"
        assert aborted == ["gen1"]
        assert a.result(TIMEOUT * 3)[0] == "error"

        v3 = _weights(3)
        a.start_sync("gen2", 1, 2, plan)
        pusher.complete(SyncRound(3, 3, "gen2", 2, {"a": 1}, True, False), v3)
        _assert_bit_exact(v3, a.result(TIMEOUT * 3))
        assert aborted == ["gen1"] and rounds.calls[-1] == "finish_sync ok=True"
    finally:
        for receiver in (a, b):
            receiver.close()
