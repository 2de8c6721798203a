"""Scorers written for veRL's reward managers other than naive. Under
``reward_model.reward_manager=prime`` veRL calls a scorer by position and reads the first
element of a tuple or list (PRIME-style scorers return ``(score, metadata)``): such scorers
scored 0 on every sample here, or were refused at load for their parameter names. A scorer
for veRL's batch manager, or one that imports veRL's own scorers, is refused with a line
that says how to port it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from asyncrl.rewards import RewardPool, load_custom_scorer, normalize_score
from asyncrl.rewards.sandbox import ScoreJob, _run_job

PRIME_STYLE = """
def compute_score(task, completion, reference, task_extra_info=None, scale=1.0):
    ok = task == "codecontests" and completion.strip() == str(reference)
    return ok * scale, {"passed": int(ok), "seen": task_extra_info}
"""

BATCH_STYLE = """
def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [float(s == g) for s, g in zip(solution_strs, ground_truths)]
"""


def write(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def test_prime_reads_the_first_element_of_a_tuple_or_list() -> None:
    assert normalize_score((True, {"passed": 1}), "prime") == (1.0, {})
    assert normalize_score([0.5, "ok"], "prime") == (0.5, {})
    assert normalize_score({"score": 0.5, "acc": 1}, "prime") == (0.5, {"acc": 1.0})
    assert normalize_score(0.25, "prime") == (0.25, {})
    with pytest.raises(ValueError, match="empty tuple"):
        normalize_score((), "prime")
    with pytest.raises(TypeError, match=r"tuple\[0\] = str"):
        normalize_score(("1.0", {}), "prime")
    # veRL's naive and dapo managers write the return into a tensor, which refuses a tuple.
    for manager in ("naive", "dapo"):
        with pytest.raises(TypeError, match="reward_model.reward_manager=prime"):
            normalize_score((1.0, {}), manager)


def test_prime_calls_the_scorer_by_position(tmp_path: Path) -> None:
    file = write(tmp_path / "prime_style.py", PRIME_STYLE)
    scorer = load_custom_scorer(file, reward_manager="prime")
    job = ScoreJob("codecontests", " 42 ", "42", {"index": 3})
    assert _run_job(scorer, "prime", job) == ("ok", (1.0, {}))
    assert _run_job(scorer, "prime", job._replace(solution_str="41")) == ("ok", (0.0, {}))
    # Under naive its parameter names cannot take veRL's keywords: refused, naming prime.
    with pytest.raises(ValueError, match="by keyword.*reward_model.reward_manager=prime"):
        load_custom_scorer(file)
    # A scorer that cannot take four positional arguments is refused under prime too.
    three = write(tmp_path / "three.py", "def compute_score(a, b, c):\n    return 1.0\n")
    with pytest.raises(ValueError, match="as veRL's prime manager calls a scorer"):
        load_custom_scorer(three, reward_manager="prime")


def test_a_pool_under_prime_scores_prime_style_scorers(tmp_path: Path) -> None:
    file = write(tmp_path / "prime_style.py", PRIME_STYLE)
    with RewardPool(
        num_workers=1, custom_path=str(file), custom_kwargs={"scale": 0.5}, reward_manager="prime"
    ) as pool:
        assert [
            (r.score, r.error)
            for r in pool.score_many(
                [
                    ("codecontests", "42", "42", {"index": 0}),
                    ("codecontests", "41", "42", {"index": 1}),
                ]
            )
        ] == [(0.5, None), (0.0, None)]
        assert pool.counters["bad_return"] == 0
    with pytest.raises(ValueError, match="reward manager 'batch' is not one of"):
        RewardPool(num_workers=1, reward_manager="batch")


def test_a_batch_scorer_is_refused_with_the_wrapper_that_ports_it(tmp_path: Path) -> None:
    file = write(tmp_path / "batch_style.py", BATCH_STYLE)
    # Refused under prime too: called by position, it would take a text for a list.
    with pytest.raises(ValueError, match="is a scorer for veRL's batch manager"):
        load_custom_scorer(file, reward_manager="prime")
    with pytest.raises(ValueError) as refused:
        load_custom_scorer(file)
    message = str(refused.value)
    assert "is a scorer for veRL's batch manager" in message
    assert "reward.custom_reward_function.name" in message
    # The wrapper the message gives, added to the file, scores one response per call.
    wrapper = message[message.index("def score_one(") :]
    ported = write(tmp_path / "ported.py", BATCH_STYLE + "\n" + wrapper + "\n")
    score_one = load_custom_scorer(ported, "score_one")
    assert score_one(data_source="x", solution_str="8", ground_truth="8", extra_info=None) == 1.0


def test_a_scorer_importing_verl_is_told_to_carry_its_own_rule(tmp_path: Path) -> None:
    file = write(
        tmp_path / "uses_verl.py",
        """
        from verl.utils.reward_score import default_compute_score

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return default_compute_score(data_source, solution_str, ground_truth, extra_info)
        """,
    )
    with pytest.raises(ValueError) as refused:
        load_custom_scorer(file)
    message = str(refused.value)
    assert "veRL's built-in scorers are not shipped here" in message
    assert "arithmetic, calculator, countdown, gsm8k, openai/gsm8k" in message
    assert "its own copy of the scoring rule" in message
    # Imported when called, it says the same when it fails.
    lazy = write(
        tmp_path / "lazy.py",
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            from verl.utils.reward_score import gsm8k
            return gsm8k.compute_score(solution_str, ground_truth)
        """,
    )
    with pytest.raises(ModuleNotFoundError, match="not shipped here"):
        _run_job(load_custom_scorer(lazy), "naive", ScoreJob("x", "y", "z"))
    # Any other missing module keeps the plain message.
    other = write(tmp_path / "other.py", "import not_a_module_here_at_all\n")
    with pytest.raises(ValueError, match="No module named 'not_a_module_here_at_all'; fix the"):
        load_custom_scorer(other)


def test_verls_reward_manager_key_reaches_the_servers_scorer(tmp_path: Path) -> None:
    """``reward_model.reward_manager`` (veRL's key) sets ``reward.reward_manager``, which
    the rollout server's pool is built with; veRL's batch manager is refused in one line."""
    from asyncrl.config import ConfigError, load_config
    from rollout_servers.main import reward_pool

    file = write(tmp_path / "prime_scorer.py", PRIME_STYLE)
    cfg = load_config(
        None,
        [
            "reward_model.reward_manager=prime",
            f"custom_reward_function.path={file}",
            "reward.num_workers=1",
        ],
    )
    assert cfg.reward.reward_manager == "prime"
    with reward_pool(cfg) as pool:
        result = pool.score("codecontests", "7", "7", None)
    assert result.score == 1.0 and result.error is None, result
    with pytest.raises(ConfigError, match="batch-level managers are not built here"):
        load_config(None, ["reward_model.reward_manager=batch"])
