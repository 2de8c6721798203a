"""Reward values veRL accepts score the same here: veRL writes a scorer's return into a
reward tensor, so numpy scalars (``np.bool_`` included), 0-d arrays and 0-d tensors are
numbers to it, and a dict part it cannot use never costs the sample its score. Each case
goes through real reward workers, as a user's scorer does."""

from __future__ import annotations

import logging
import textwrap

import pytest

from asyncrl.rewards import RewardPool, ScoreResult, normalize_score

SCORER = """
import numpy as np

try:  # veRL users' scorers often compute with torch; the workers must not need it
    import torch
except ImportError:
    torch = None

VALUES = {
    "np_bool": np.bool_(True),
    "np_float32": np.float32(0.5),
    "np_int64": np.int64(2),
    "array_0d": np.array(1.0),
    "py_bool": True,
    "dict_np_bool_score": {"score": np.bool_(True)},
    "dict_np_bool_acc": {"score": 1.0, "acc": np.bool_(True)},
    "dict_one_bad_part": {"score": 1.0, "n": 10**400, "acc": np.float32(0.5)},
    "dict_text_parts": {"score": np.int64(2), "pred": "72", "missing": None, "v": [1, 2]},
    "dict_nan_part": {"score": 0.5, "nan": float("nan"), "acc": 0.0},
    "array_1d": np.array([1.0, 2.0]),
    "array_0d_str": np.array("1.0"),
    "np_nan": np.float64("nan"),
    "huge_int": 10**400,
    "past_float32": 1e39,  # a float64, but inf in the learner's float32
    "str": "1.0",
    "dict_bad_score": {"score": np.array([1.0]), "acc": 1.0},
}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "torch_0d":
        return torch.tensor(1.0)
    if data_source == "torch_dict":
        return {"score": torch.tensor(0.25), "acc": torch.tensor(True)}
    if data_source == "torch_1d":
        return torch.tensor([1.0])
    return VALUES[data_source]
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory):
    file = tmp_path_factory.mktemp("reward") / "values.py"
    file.write_text(textwrap.dedent(SCORER))
    # One worker: the machine running the tests may have two cores.
    with RewardPool(num_workers=1, timeout_s=10.0, custom_path=str(file)) as pool:
        yield pool


@pytest.mark.parametrize(
    ("data_source", "expected"),
    [
        ("np_bool", ScoreResult(1.0, {})),
        ("np_float32", ScoreResult(0.5, {})),
        ("np_int64", ScoreResult(2.0, {})),
        ("array_0d", ScoreResult(1.0, {})),
        ("py_bool", ScoreResult(1.0, {})),
        ("dict_np_bool_score", ScoreResult(1.0, {})),
        # DAPO's filter_groups.metric=acc reads this part; dropped, it fell back to score.
        ("dict_np_bool_acc", ScoreResult(1.0, {"acc": 1.0})),
        # One part no float can hold costs only that part, not the sample.
        ("dict_one_bad_part", ScoreResult(1.0, {"acc": 0.5})),
        ("dict_text_parts", ScoreResult(2.0, {})),
        ("dict_nan_part", ScoreResult(0.5, {"acc": 0.0})),
    ],
)
def test_values_verl_accepts_are_scored(
    pool: RewardPool, data_source: str, expected: ScoreResult
) -> None:
    assert pool.score(data_source, "x", "y") == expected


@pytest.mark.parametrize(
    "data_source",
    ["array_1d", "array_0d_str", "np_nan", "huge_int", "past_float32", "str", "dict_bad_score"],
)
def test_values_that_are_not_one_finite_number_are_bad_returns(
    pool: RewardPool, data_source: str
) -> None:
    """Not one number (veRL's tensor write refuses these too) or not finite: score 0 and
    counted as ``bad_return``, never as a scorer that raised."""
    before = pool.counters["bad_return"]
    assert pool.score(data_source, "x", "y") == ScoreResult(0.0, {}, "bad_return")
    assert pool.counters["bad_return"] == before + 1


@pytest.mark.parametrize(
    ("data_source", "expected"),
    [
        ("torch_0d", ScoreResult(1.0, {})),
        ("torch_dict", ScoreResult(0.25, {"acc": 1.0})),
        ("torch_1d", ScoreResult(0.0, {}, "bad_return")),
    ],
)
def test_torch_tensors(pool: RewardPool, data_source: str, expected: ScoreResult) -> None:
    pytest.importorskip("torch")
    assert pool.score(data_source, "x", "y") == expected


def test_a_dropped_part_is_logged_once_per_key_and_type(caplog: pytest.LogCaptureFixture) -> None:
    """A part the user meant as a metric must not vanish without a word, nor flood the log;
    text parts (a parsed prediction) are expected and stay quiet."""
    value = {"score": 1.0, "dropped_once": 10**400, "pred": "72"}
    with caplog.at_level(logging.WARNING, logger="asyncrl.rewards.registry"):
        for _ in range(3):
            assert normalize_score(value) == (1.0, {})
    lines = [r.getMessage() for r in caplog.records]
    assert sum("'dropped_once'" in line for line in lines) == 1, lines
    assert not any("'pred'" in line for line in lines), lines


def test_a_part_whose_name_no_trajectory_carries_is_left_out_and_the_group_is_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by a review: a part named in more characters than a trajectory's keys take
    (256) scored normally, then every group holding it failed to encode at the server, was
    dealt again, failed the same way and was given up, with only a traceback to say why."""
    from asyncrl.wire import Trajectory, encode_trajectories

    long_key = "k" * 300
    with caplog.at_level(logging.WARNING, logger="asyncrl.rewards.registry"):
        score, parts = normalize_score({"score": 1.0, long_key: 0.5, "acc": 1.0})
    assert (score, parts) == (1.0, {"acc": 1.0})
    [line] = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert "its name has 300 characters" in line and "at most 256" in line, line
    t = Trajectory.build(
        task_id="t/0/0", group_index=0, group_size=1, prompt_ids=[1, 2], response_ids=[3],
        logprobs=[-0.5], version_spans=[(0, 1)], reward=score, reward_parts=parts,
    )  # fmt: skip
    assert encode_trajectories([t])
