"""Scorers on hand-made correct, wrong, malformed and hostile responses, and the RewardPool
on misbehaving scorers, with real worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.rewards import (
    KNOWN_DATA_SOURCES,
    RewardPool,
    ScoreResult,
    default_compute_score,
    load_custom_scorer,
    normalize_score,
)
from asyncrl.tasks import arithmetic, countdown, gsm8k
from tests.helpers import alive, wait_until

GT = {"target": 24, "numbers": [2, 3, 4]}


def answer(equation: str) -> str:
    return f"<think>let me try</think> <answer>{equation}</answer>"


# ---------------------------------------------------------------------------- countdown
# TinyZero's rule (tests/test_reward_countdown.py holds its table and the comparison with
# it): 0 without an answer on the last line, 0.1 for any answer that is not correct, 1.0
# for a correct one.


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (answer("(4 - 2) * 3 * 4 + 18 - 18"), 0.1),  # extra numbers
        (answer("2 * 3 * 4 / 4 * 4"), 0.1),  # 4 used three times
        (answer("2 * 12"), 0.1),  # wrong numbers, right value
        (answer("3 * 4"), 0.1),  # 2 unused
        (answer("2 + 3 + 4"), 0.1),  # uses all, misses the target
        (answer("4 * 3 - 2"), 0.1),
        (answer("4 / 3 / 2"), 0.1),  # 2/3, not 24
        ("no answer at all", 0.0),
        ("<answer></answer>", 0.1),  # an empty answer is an answer
        ("<answer>2 * 3 * 4", 0.0),  # unterminated
        (answer("__import__('os').system('echo hi')"), 0.1),  # never run
        (answer("2**99999999"), 0.1),
        (answer("9999999999**9999"), 0.1),
        (answer("2 * 3 * 4 + 1000000 - 1000000"), 0.1),
        (answer("2 ** 3 * 4 - 8"), 0.1),  # 8 is not given
        (answer("4 // 2 * 3"), 0.1),  # floor division evaluates: 6
        (answer("2.0 * 3 * 4"), 0.1),  # its 0 is a number not given
        (answer("2e0 * 3 * 4"), 0.1),
        (answer("abs(2 * 3 * 4)"), 0.1),
        (answer("2 * 3 * 4 = 24"), 0.1),
        (answer("[2, 3, 4]"), 0.1),
        (answer("2 @ 3 @ 4"), 0.1),
        (answer("\uff12 * 3 * 4"), 0.1),  # a full-width digit: no Python number
        (answer("2 * 3 * 4 if 1 else 0"), 0.1),
        (answer("08 * 3 * 4"), 0.1),  # Python refuses a leading zero
        (answer("..."), 0.1),
        (answer("(2)(3)(4)"), 0.1),  # a call: eval raises
    ],
)
def test_countdown_wrong_and_malformed(response: str, expected: float) -> None:
    assert countdown.compute_score(response, GT) == expected


def test_countdown_division_by_zero_is_an_answer_but_wrong() -> None:
    assert (
        countdown.compute_score(answer("5 / (2 - 2)"), {"target": 5, "numbers": [2, 2, 5]}) == 0.1
    )


@pytest.mark.parametrize(
    ("equation", "numbers", "target"),
    [
        ("2 * 3 * 4", [2, 3, 4], 24),
        ("((4 * (3)) * ((2)))", [4, 3, 2], 24),  # nested parentheses, any order of numbers
        ("(" * 150 + "2 * 3 * 4" + ")" * 150, [2, 3, 4], 24),  # within Python's 200 levels
        ("  8*3 \t*( 4/4 ) ", [3, 4, 4, 8], 24),  # whitespace, a repeated number
        ("-3 + 8 * 4 - 5", [3, 8, 4, 5], 24),  # unary minus
        ("7 / 2 * 4 - -10", [7, 2, 4, 10], 24),  # fractions in between
        ("1 / 3 * 3", [1, 3, 3], 1),  # within 1e-5
        ("2 ** 3 * 3", [2, 3, 3], 24),  # powers evaluate, as eval does
        ("4 // 3 * 24", [4, 3, 24], 24),
        ("2.4 * 10", [2, 4, 10], 24),  # a decimal point joins two given numbers
    ],
)
def test_countdown_correct(equation: str, numbers: list[int], target: int) -> None:
    truth = {"target": target, "numbers": numbers}
    assert countdown.compute_score(answer(equation), truth) == 1.0


def test_countdown_reads_the_last_answer_on_the_last_line() -> None:
    assert countdown.compute_score(answer("2 * 3 * 4") + answer("2 + 3 + 4"), GT) == 0.1
    assert countdown.compute_score(answer("2 + 3 + 4") + "\n" + answer("2 * 3 * 4"), GT) == 1.0
    assert countdown.compute_score(answer("2 * 3 * 4") + "\n" + answer("2 + 3 + 4"), GT) == 0.1
    assert countdown.compute_score(answer("2 * 3 * 4") + "\nSo it is 24.", GT) == 0.0
    assert countdown.compute_score(answer("2 * 3 * 4") + "\n", GT) == 0.0  # an empty last line
    assert (
        countdown.compute_score("<answer>8 *\n3</answer>", {"target": 24, "numbers": [8, 3]}) == 0.0
    )
    assert countdown.compute_score("<answer>x</answer> <answer>4*3*2</answer>", GT) == 1.0
    # An <answer> pairs with the first </answer> after it, as TinyZero's pattern pairs them.
    assert countdown.compute_score("<answer>a<answer>4*3*2</answer>", GT) == 0.1
    assert countdown.compute_score("<answer>4*3*2</answer></answer>", GT) == 1.0
    # The response alone is scored: an assistant marker in it is text like any other.
    assert countdown.compute_score(answer("2 * 3 * 4") + " Assistant: done", GT) == 1.0
    with pytest.raises(ValueError, match="ground_truth"):
        countdown.compute_score(answer("3"), {"numbers": [3]})


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/() .e_x<>answer", max_size=80))
def test_countdown_never_raises_on_any_text(body: str) -> None:
    assert countdown.compute_score(answer(body), GT) in (0.0, 0.1, 1.0)


# ------------------------------------------------------------------------ gsm8k, arithmetic


def test_gsm8k_strict_and_flexible() -> None:
    full = "She sold 48 + 24 = 72 clips.\n#### 72"
    for truth in ("72", full, "$72"):  # not "72.0": veRL compares strings
        assert gsm8k.compute_score("48 + 24 = 72 so\n#### 72", truth) == 1.0
    assert gsm8k.compute_score("#### 1,234", "1234") == 1.0
    assert gsm8k.compute_score("#### $1234.", "1,234") == 0.0  # veRL: "$" is no answer
    assert gsm8k.compute_score("#### 5 then later #### 72", "72") == 1.0  # the last ####
    assert gsm8k.compute_score("#### 71", "72") == 0.0
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("the answer is 72", "72") == 0.0  # strict needs ####
    assert gsm8k.compute_score("the answer is 72", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("so 70, no: -72.5", "-72.50", method="flexible") == 0.0
    assert gsm8k.compute_score("no numbers", "72", method="flexible", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 1", "1e999999999") == 0.0  # never built as a number
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("#### 1", "1", method="fuzzy")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("8", 1.0),
        (" 8 ", 1.0),
        ("8\n9+9=18", 1.0),
        ("8<|im_end|>junk", 1.0),
        ("8<|endoftext|>", 1.0),
        ("9", 0.0),
        ("08", 0.0),
        ("8.0", 0.0),
        ("=8", 0.0),
        ("", 0.0),
        ("\n8", 0.0),
        ("88", 0.0),
    ],
)
def test_arithmetic_score(response: str, expected: float) -> None:
    assert arithmetic.compute_score(response, "8") == expected


def test_default_compute_score_dispatch() -> None:
    assert set(KNOWN_DATA_SOURCES) == {
        "arithmetic",
        "calculator",
        "countdown",
        "gsm8k",
        "openai/gsm8k",
    }
    assert (
        default_compute_score("calculator", "<tool_call>..</tool_call>\ntool\n12\n12", "12") == 1.0
    )
    assert default_compute_score("arithmetic", "8", "8") == 1.0
    assert default_compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    assert default_compute_score("gsm8k", "#### 7", "72") == 0.0
    assert default_compute_score("countdown", answer("3 * 8"), {"target": 24, "numbers": [8, 3]})
    with pytest.raises(KeyError, match="custom_reward_function.path"):
        default_compute_score("math500", "x", "y")


# ------------------------------------------------------------------------- custom scorers


def write_scorer(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def test_custom_scorer_float_and_dict(tmp_path: Path) -> None:
    file = write_scorer(
        tmp_path / "my_reward.py",
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str == ground_truth)

        def with_parts(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": 0.5, "format": 1, "pred": "x", "acc": True}
        """,
    )
    scorer = load_custom_scorer(str(file))
    assert scorer("any", "a", "a") == 1.0
    value = load_custom_scorer(file, "with_parts")("any", "a", "b")
    assert normalize_score(value) == (0.5, {"format": 1.0, "acc": 1.0})
    assert normalize_score(3) == (3.0, {})
    for bad in ("abc", float("nan"), float("inf"), None, {"format": 1.0}, [1.0]):
        with pytest.raises((TypeError, ValueError)):
            normalize_score(bad)


def test_custom_scorer_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="custom_reward_function.path"):
        load_custom_scorer(tmp_path / "missing.py")
    file = write_scorer(tmp_path / "other.py", "def score(*a):\n    return 1.0\n")
    with pytest.raises(
        ValueError, match="no function 'compute_score'.*custom_reward_function.name"
    ):
        load_custom_scorer(file)
    broken = write_scorer(tmp_path / "broken.py", "raise RuntimeError('bad import')\n")
    with pytest.raises(ValueError, match="bad import"):
        load_custom_scorer(broken)
    # Every call of this one raised a TypeError: a run trained on zero rewards, rc 0.
    two = write_scorer(
        tmp_path / "two.py", "def compute_score(solution_str, ground_truth):\n    return 1.0\n"
    )
    with pytest.raises(
        ValueError, match=r"two.py: compute_score\(solution_str, ground_truth\) cannot be called"
    ):
        load_custom_scorer(two)
    loose = write_scorer(
        tmp_path / "loose.py", "def compute_score(solution_str, **kw):\n    return 1.0\n"
    )
    call = {"data_source": "a", "solution_str": "b", "ground_truth": "c", "extra_info": None}
    assert load_custom_scorer(loose)(**call) == 1.0
    with pytest.raises(
        ValueError, match="data_source, solution_str, ground_truth, extra_info, scale"
    ):
        load_custom_scorer(two, bound={"scale": 2})


# ---------------------------------------------------------------------------- RewardPool

HOSTILE = """
import math
import os
import time

from asyncrl.rewards import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "raise":
        raise RuntimeError("boom")
    if data_source == "abc":
        return "abc"
    if data_source == "nan":
        return math.nan
    if data_source == "none":
        return None
    if data_source == "sleep":
        time.sleep(30)
    if data_source == "pow":
        pow(10, 10**8)  # big-integer C code: holds the GIL for a long time
    if data_source == "die":
        os._exit(3)
    if data_source == "parts":
        return {"score": 0.5, "format": 1.0}
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory):
    file = write_scorer(tmp_path_factory.mktemp("reward") / "hostile.py", HOSTILE)
    with RewardPool(num_workers=2, timeout_s=TIMEOUT_S, custom_path=str(file)) as pool:
        yield pool


@pytest.mark.parametrize(
    ("data_source", "kind"),
    [("raise", "exception"), ("abc", "bad_return"), ("nan", "bad_return"), ("die", "worker_died")],
)
def test_pool_counts_bad_scorers(pool: RewardPool, data_source: str, kind: str) -> None:
    before = pool.counters[kind]
    assert pool.score(data_source, "x", "y") == ScoreResult(0.0, {}, kind)
    assert pool.counters[kind] == before + 1
    assert pool.score("arithmetic", "8", "8") == ScoreResult(1.0, {}, None)


def test_each_kind_of_bad_return_is_logged_once(tmp_path: Path, caplog) -> None:
    """A scorer returning a string, None or NaN makes three mistakes: each is named once in
    the log (before, only the first bad return of a run was, and None never showed), while
    every case is counted."""
    file = write_scorer(tmp_path / "hostile.py", HOSTILE)
    # a pool of its own: the module's pool may have logged some of these already
    with RewardPool(num_workers=2, timeout_s=5.0, custom_path=str(file)) as pool:
        with caplog.at_level("WARNING"):
            for source in ("abc", "none", "nan", "none", "abc", "nan"):
                assert pool.score(source, "x", "y").error == "bad_return"
        assert pool.counters["bad_return"] == 6
    named = [r.getMessage() for r in caplog.records if "reward function returned" in r.getMessage()]
    assert len(named) == 3, named
    for says in ("str 'abc', not a number", "NoneType None, not a number", "nan, not a finite"):
        assert sum(says in line for line in named) == 1, (says, named)


@pytest.mark.parametrize("data_source", ["sleep", "pow"])
def test_pool_times_out_and_recovers(pool: RewardPool, data_source: str) -> None:
    before = pool.counters["timeout"]
    start = time.monotonic()
    result = pool.score(data_source, "x", "y")
    elapsed = time.monotonic() - start
    assert result == ScoreResult(0.0, {}, "timeout")
    assert elapsed < TIMEOUT_S + 1.0
    assert pool.counters["timeout"] == before + 1
    # Both the surviving worker and the replacement keep scoring correctly.
    for _ in range(4):
        assert pool.score("arithmetic", "8", "8").score == 1.0


def test_a_worker_killed_while_idle_is_replaced_and_the_job_still_scored() -> None:
    """An idle reward worker killed from outside (the OOM killer, an operator): the next job
    sent to it never started, so another worker scores it instead of the group failing."""
    with RewardPool(num_workers=2, timeout_s=5.0) as pool:
        for worker in pool._pool.workers:
            worker.process.kill()
            worker.process.join(5)
        results = pool.score_many([("arithmetic", "8", "8")] * 4)
        assert [r.score for r in results] == [1.0] * 4 and all(r.error is None for r in results)
        assert pool.counters["worker_died"] == 0  # no job was lost to it


def test_pool_dict_return_and_order(pool: RewardPool) -> None:
    assert pool.score("parts", "x", "y") == ScoreResult(0.5, {"format": 1.0}, None)
    items = [("arithmetic", str(i), str(i if i % 3 else i + 1)) for i in range(20)]
    results = pool.score_many(items)
    assert [r.score for r in results] == [0.0 if i % 3 == 0 else 1.0 for i in range(20)]
    assert all(r.error is None for r in results)


def test_pool_from_four_threads(pool: RewardPool) -> None:
    results: dict[int, list[float]] = {}

    def work(n: int) -> None:
        results[n] = [pool.score("arithmetic", str(n + k), str(n + k)).score for k in range(5)]
        results[n] += [r.score for r in pool.score_many([("gsm8k", "#### 1", "2")] * 3)]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {n: [1.0] * 5 + [0.0] * 3 for n in range(4)}


def test_pool_startup_errors_surface_at_construction(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match="custom_reward_function.path"):
        RewardPool(custom_path=str(tmp_path / "missing.py"))
    no_function = write_scorer(tmp_path / "no_fn.py", "x = 1\n")
    with pytest.raises(ValueError, match="no function 'compute_score'"):
        RewardPool(num_workers=1, custom_path=str(no_function))
    assert time.monotonic() - start < 30


def test_pool_close_stops_workers() -> None:
    pool = RewardPool(num_workers=2, timeout_s=5.0)
    processes = [worker.process for worker in pool._workers]
    assert pool.score("arithmetic", "8", "8").score == 1.0
    pool.close()
    pool.close()  # idempotent
    assert not any(process.is_alive() for process in processes)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score("arithmetic", "8", "8")


def test_workers_do_not_outlive_a_parent_that_never_closes() -> None:
    script = (
        "from asyncrl.rewards import RewardPool\n"
        "if __name__ == '__main__':\n"
        "    pool = RewardPool(num_workers=2)\n"
        "    print(*[w.process.pid for w in pool._workers], flush=True)\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    wait_until(lambda: not any(alive(pid) for pid in pids), "the workers to exit", 5)


def test_imports_stay_light() -> None:
    # Reward workers import these; they must not pull in torch, vLLM, transformers or pyarrow.
    script = (
        "import sys, asyncrl.tasks, asyncrl.rewards\n"
        "heavy = ('torch', 'vllm', 'transformers', 'pyarrow', 'pandas')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_reward_kwargs_reach_the_scoring_function(tmp_path):
    """veRL's custom_reward_function.reward_kwargs: keyword arguments bound to the user's
    function on every call, through the config to the reward workers."""
    from asyncrl.config import load_config

    file = write_scorer(
        tmp_path / "scaled.py",
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
        "    return scale * float(solution_str == ground_truth)\n",
    )
    cfg = load_config(
        None,
        [f"custom_reward_function.path={file}", "custom_reward_function.reward_kwargs.scale=0.5"],
    )
    custom = cfg.reward.custom_reward_function
    with RewardPool(
        num_workers=1, custom_path=custom.path, custom_kwargs=custom.reward_kwargs
    ) as pool:
        assert pool.score("any", "8", "8").score == 0.5
    with RewardPool(num_workers=1, custom_path=custom.path) as pool:
        assert pool.score("any", "8", "8").score == 1.0
    # Without a custom scorer they are unused, as in veRL, and said so (every sample of the
    # built-in scorers raised on the unexpected keyword, and scored 0).
    from asyncrl.config.advisories import config_advisories

    cfg = load_config("configs/cpu_demo.yaml", ["custom_reward_function.reward_kwargs.scale=0.5"])
    [line] = config_advisories(cfg)
    assert "reward_kwargs={'scale': 0.5} is unused" in line
    with RewardPool(num_workers=1, custom_kwargs={"scale": 0.5}) as pool:
        result = pool.score("arithmetic", "8", "8")
        assert (result.score, result.error) == (1.0, None)
