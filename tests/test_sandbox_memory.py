"""The memory cap of each scorer worker (``reward.max_memory_mb``), with real worker
processes: a scorer that runs out of memory under it scores 0 as ``out_of_memory`` with a
line naming the key, its worker is replaced, the next sample scores normally, and a scorer
under the cap is unaffected. Without a cap, one leaking or huge scorer could take the
rollout server's machine down."""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.rewards import RewardPool, ScoreResult
from tests.helpers import alive, wait_until

CAP_MB = 300

SCORER = """
import os, resource

_hoard = []  # what the leaking scorer keeps: its module holds it past the job

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "pid":
        return float(os.getpid())
    if data_source == "limit":  # the worker's cap on its memory, in MiB (-1: none)
        soft = resource.getrlimit(resource.RLIMIT_DATA)[0]
        return -1.0 if soft == resource.RLIM_INFINITY else float(soft >> 20)
    if data_source == "huge":  # 1 GiB at once, far past a 300 MB cap
        return float(len(bytearray(1 << 30)))
    if data_source == "leak":  # grows to 1 GiB unless the cap stops it, keeping all it took
        for _ in range(100):  # bounded: where the cap fails, the test fails, not the machine
            _hoard.append(bytearray(10 << 20))
        return float(len(_hoard))
    if data_source == "wrapped":  # a scorer that turns every failure into its own error
        try:
            bytearray(1 << 30)
        except MemoryError as exc:
            raise ValueError("could not check the answer") from exc
    if data_source == "mmap":  # an OSError(ENOMEM), not a MemoryError
        import mmap
        return float(len(mmap.mmap(-1, 1 << 30, flags=mmap.MAP_PRIVATE)))
    if data_source == "torch":  # torch's allocator: a RuntimeError naming the want
        import torch
        return float(torch.empty(1 << 28).numel())
    if data_source == "small":  # well under the cap
        block = bytearray(int(solution_str) << 20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page: really resident
        return float(len(block) >> 20)
    return 1.0
"""


@pytest.fixture(scope="module")
def scorer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    file = tmp_path_factory.mktemp("memory") / "scorer.py"
    file.write_text(SCORER)
    return file


@pytest.fixture
def pool(scorer: Path) -> Iterator[RewardPool]:
    with RewardPool(
        num_workers=1, timeout_s=20.0, custom_path=str(scorer), max_memory_mb=CAP_MB
    ) as pool:
        yield pool


def _pid(pool: RewardPool) -> int:
    return int(pool.score("pid", "", None).score)


def _check_replaced(pool: RewardPool, old_pid: int) -> None:
    """The worker that hit the cap is gone and a fresh one scores the next sample."""
    wait_until(lambda: not alive(old_pid), "the worker that hit the cap to be killed", 10)
    assert pool.score("small", "100", None) == ScoreResult(100.0, {}, None)
    assert _pid(pool) != old_pid


# ------------------------------------------------------------ 1. a scorer past the cap


def test_a_scorer_past_the_cap_scores_0_naming_the_key_and_the_next_scores(
    pool: RewardPool, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing capped a scorer's memory: a 1 GiB allocation went through (or took the
    machine down); now it is the sample's memory failure and the pool serves on."""
    old_pid = _pid(pool)
    with caplog.at_level(logging.WARNING, logger="asyncrl.rewards.sandbox"):
        assert pool.score("huge", "", None) == ScoreResult(0.0, {}, "out_of_memory")
    assert pool.counters["out_of_memory"] == 1
    assert pool.counters["exception"] == 0 and pool.counters["worker_died"] == 0
    [record] = [r for r in caplog.records if "out of memory" in r.getMessage()]
    line = record.getMessage()
    assert "\n" not in line
    assert f"under the {CAP_MB} MiB cap" in line and "raise reward.max_memory_mb" in line
    _check_replaced(pool, old_pid)


def test_a_leaking_scorer_gets_a_fresh_worker_after_it_hits_the_cap(pool: RewardPool) -> None:
    """A scorer that keeps what it took (a module-level cache) left its worker full:
    reused, every later sample would run out of memory too."""
    old_pid = _pid(pool)
    assert pool.score("leak", "", None) == ScoreResult(0.0, {}, "out_of_memory")
    _check_replaced(pool, old_pid)
    assert pool.counters["out_of_memory"] == 1


def test_a_memory_error_the_scorer_wrapped_is_still_the_caps(pool: RewardPool) -> None:
    """veRL scorers often re-raise their own error: the cause is still the cap."""
    old_pid = _pid(pool)
    assert pool.score("wrapped", "", None) == ScoreResult(0.0, {}, "out_of_memory")
    _check_replaced(pool, old_pid)


@pytest.mark.parametrize("kind", ["mmap", "torch"])
def test_out_of_memory_from_a_system_call_or_torch_is_the_caps_too(scorer: Path, kind: str) -> None:
    """Found by a review: only a MemoryError counted. An ``mmap`` past the cap raises
    OSError(ENOMEM) and torch's CPU allocator a RuntimeError: both were plain exceptions,
    and a leaking torch scorer failed every later sample on the same full worker."""
    # torch itself takes about 400 MiB once imported: a cap it fits under, 1 GiB past it
    with RewardPool(
        num_workers=1, timeout_s=60.0, custom_path=str(scorer), max_memory_mb=900
    ) as pool:
        old_pid = _pid(pool)
        assert pool.score(kind, "", None) == ScoreResult(0.0, {}, "out_of_memory")
        assert pool.counters["out_of_memory"] == 1 and pool.counters["exception"] == 0
        wait_until(lambda: not alive(old_pid), "the worker that hit the cap to be killed", 10)
        assert _pid(pool) != old_pid


# ------------------------------------------------------------ 2. a scorer under the cap


def test_a_scorer_under_the_cap_is_unaffected(pool: RewardPool) -> None:
    """The cap is set in the worker, and a scorer within it scores on the same worker."""
    pid = _pid(pool)
    assert pool.score("limit", "", None).score == CAP_MB
    for _ in range(3):  # what a job frees is not counted against the next
        assert pool.score("small", "100", None) == ScoreResult(100.0, {}, None)
    assert _pid(pool) == pid
    assert not any(pool.counters.values())


def test_a_cap_of_0_is_no_cap(scorer: Path) -> None:
    with RewardPool(num_workers=1, custom_path=str(scorer), max_memory_mb=0) as pool:
        soft = resource.getrlimit(resource.RLIMIT_DATA)[0]
        expected = -1.0 if soft == resource.RLIM_INFINITY else float(soft >> 20)
        assert pool.score("limit", "", None).score == expected
        assert pool.score("huge", "", None) == ScoreResult(float(1 << 30), {}, None)


# ------------------------------------------------------- 3. the key, start-up included


def test_reward_max_memory_mb_reaches_the_workers(scorer: Path) -> None:
    from rollout_servers.main import reward_pool

    base = [f"reward.custom_reward_function.path={scorer}", "reward.num_workers=1"]
    assert load_config(None, base).reward.max_memory_mb == 8192
    with pytest.raises(ConfigError, match="reward.max_memory_mb"):
        load_config(None, [*base, "reward.max_memory_mb=-1"])
    with reward_pool(load_config(None, [*base, f"reward.max_memory_mb={CAP_MB}"])) as pool:
        assert pool.max_memory_mb == CAP_MB
        assert pool.score("limit", "", None).score == CAP_MB
        assert pool.score("huge", "", None).error == "out_of_memory"


def test_a_scorer_module_past_the_cap_at_import_names_the_key(tmp_path: Path) -> None:
    """A module that loads too much on import fails at start, in one line, not on every
    sample."""
    heavy = tmp_path / "heavy_scorer.py"
    heavy.write_text(
        "_table = bytearray(1 << 30)  # a model loaded at import\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0\n"
    )
    with pytest.raises(ValueError) as refused:
        RewardPool(num_workers=1, custom_path=str(heavy), max_memory_mb=CAP_MB)
    line = str(refused.value)
    assert "\n" not in line and "ran out of memory while starting" in line
    assert line.endswith("or raise reward.max_memory_mb (0: no cap)")
