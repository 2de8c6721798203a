"""The scheduler simulation against hand-computed cases (benchmarks/sim_model.py, simulate.py)."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from unittest.mock import MagicMock

import pytest
import yaml

from benchmarks import simulate as cli
from benchmarks.sim_model import compare_lags, simulate
from benchmarks.sim_types import ResponseLengths, SimParams

FIXED = ResponseLengths(median=100, sigma=0.0, max_length=1000)


def two_stage(gen_s: float, train_s: float, n: int = 2, batch: int = 4) -> SimParams:
    """One server whose slots hold exactly one batch, fixed response length 100 and decode
    cost proportional to the batch: generating a batch takes ``gen_s``, training ``train_s``,
    syncs are free."""
    slots = batch * n
    return SimParams(
        num_servers=1,
        max_num_seqs=slots,
        n=n,
        train_batch_size=batch,
        decode_fixed_s=0.0,
        decode_per_seq_s=gen_s / (100 * slots),
        train_s_per_token=train_s / (slots * 100),
        lengths=FIXED,
    )


@pytest.mark.parametrize(("gen_s", "train_s"), [(10.0, 6.0), (6.0, 10.0), (7.0, 7.0)])
@pytest.mark.parametrize("lag", [1, 2])
def test_async_two_stage_pipeline_runs_at_the_slower_stage(gen_s, train_s, lag):
    p = two_stage(gen_s, train_s)
    r = simulate(p, max_policy_lag=lag, steps=8, seed=0)
    expected = p.train_batch_size * p.n / max(gen_s, train_s)  # samples/s
    assert r.samples_per_s == pytest.approx(expected, rel=1e-9)
    assert r.step_times[-4:] == pytest.approx([max(gen_s, train_s)] * 4, rel=1e-9)
    assert r.ratio_to_ideal == pytest.approx(1.0, rel=1e-9)
    assert r.drops_lag == 0


def test_sync_mode_step_is_generation_plus_training_plus_sync():
    n, batch, length, prompt = 4, 6, 50, 10
    p = SimParams(
        num_servers=2,
        max_num_seqs=64,
        n=n,
        train_batch_size=batch,
        decode_fixed_s=0.01,
        decode_per_seq_s=0.001,
        prefill_s_per_token=0.002,
        prompt_length=prompt,
        lengths=ResponseLengths(median=length, sigma=0.0, max_length=1000),
        train_s_per_token=0.003,
        train_fixed_s=1.5,
        learner_gpus=2,
        learner_efficiency=0.9,
        weight_bytes=8e9,
        sync_bandwidth=4e9,
        sync_fixed_s=0.5,
        tasks_per_request=1,
    )
    r = simulate(p, max_policy_lag=0, steps=5, seed=3)
    # Round-robin dealing, one task per request: each server gets half the batch.
    per_server = batch // 2
    gen = per_server * prompt * 0.002 + length * p.t_step(per_server * n)
    tokens = batch * n * (prompt + length)
    train = (0.003 * tokens + 1.5) / (2 * 0.9)
    sync = 0.5 + 8e9 / 4e9
    assert r.step_times == pytest.approx([gen + train + sync] * len(r.step_times), rel=1e-12)
    assert r.mean_lag == 0 and r.max_lag == 0


@pytest.mark.parametrize("lag", [0, 1, 2, 4])
def test_lag_never_exceeds_the_limit_and_deals_stay_within_the_budget(lag):
    lengths = ResponseLengths(median=40, sigma=1.0, max_length=400, prompt_share=0.3)
    p = SimParams(
        num_servers=3,
        max_num_seqs=24,
        n=4,
        train_batch_size=5,
        decode_fixed_s=0.02,
        decode_per_seq_s=0.002,
        lengths=lengths,
        train_s_per_token=0.0005,
        sync_fixed_s=0.3,
    )
    r = simulate(p, max_policy_lag=lag, steps=30, seed=1)
    assert r.max_lag <= lag
    assert all(k <= lag for k in r.lag_hist)
    assert r.max_budget_excess <= 0
    if lag == 0:
        assert r.lag_hist == {0: 30 * 5} and r.drops_lag == 0


def test_ratio_to_ideal_is_at_most_one_in_random_configs():
    rng = random.Random(7)
    for _ in range(12):
        n = rng.choice([1, 2, 4, 8])
        p = SimParams(
            num_servers=rng.randint(1, 5),
            max_num_seqs=n * rng.randint(1, 8),
            n=n,
            train_batch_size=rng.randint(1, 6),
            sync_every=rng.randint(1, 2),
            decode_fixed_s=rng.uniform(0.0, 0.05),
            decode_per_seq_s=rng.uniform(0.0005, 0.005),
            prompt_length=rng.randint(0, 8),
            prefill_s_per_token=rng.uniform(0, 0.001),
            lengths=ResponseLengths(
                median=rng.uniform(20, 200), sigma=rng.uniform(0, 1.2), max_length=800
            ),
            train_s_per_token=rng.uniform(1e-5, 2e-3),
            train_fixed_s=rng.uniform(0, 1),
            learner_gpus=rng.randint(1, 4),
            learner_efficiency=rng.uniform(0.8, 1.0),
            sync_fixed_s=rng.uniform(0, 2),
        )
        r = simulate(p, max_policy_lag=rng.choice([0, 1, 2, 4]), steps=12, seed=rng.randint(0, 99))
        assert 0 < r.ratio_to_ideal <= 1.03, (p, r.ratio_to_ideal)
        assert 0 <= r.learner_wait_frac <= 1 and 0 <= r.rollout_wait_frac <= 1


def test_compare_lags_puts_sync_first_and_divides_by_it():
    results = compare_lags(two_stage(10.0, 6.0), [2, 1], steps=6, seed=0)
    assert [r.max_policy_lag for r in results] == [0, 1, 2]
    assert results[0].ratio_to_sync == 1.0
    # sync: 10 + 6 per step; async: max(10, 6)
    assert results[1].ratio_to_sync == pytest.approx(16 / 10, rel=1e-9)


def test_empirical_lengths_match_the_same_fixed_distribution():
    fixed = simulate(two_stage(8.0, 5.0), max_policy_lag=1, steps=5, seed=0)
    emp = replace(two_stage(8.0, 5.0), lengths=ResponseLengths(empirical=(100, 100)))
    assert simulate(emp, max_policy_lag=1, steps=5, seed=0).step_times == fixed.step_times


def test_derived_costs_from_the_shipped_parameters_are_consistent():
    spec = cli.load_spec(cli.DEFAULT_PARAMS)
    params, d = cli.derive(spec)
    assert d["response_sigma"] == pytest.approx(0.967, abs=0.01)
    assert d["truncated_frac"] == pytest.approx(0.05, abs=0.005)
    assert params.n <= params.max_num_seqs <= spec["rollout"]["max_num_seqs_default"]
    # the KV cache of a full batch at the mean context fits in the KV budget
    assert params.max_num_seqs * d["decode_context"] <= d["kv_capacity_tokens"]
    assert d["decode_fixed_s"] == pytest.approx(7.61e9 * 2 / (3.35e12 * 0.77))
    rows = cli.splits(params, 64, [0.25, 0.5], 0.10, d)
    assert sum(r["best_balance"] for r in rows) == 1
    assert all(r["rollout"] + r["learner"] == 64 for r in rows)


def test_cli_on_a_tiny_spec_reports_and_ends_with_the_headline(tmp_path, capsys, monkeypatch):
    written = {}

    def fake_write(name, out_dir, *, figures, config, plot):  # matplotlib is slow to import
        fig = MagicMock()
        fig.subplots.return_value = (MagicMock(), MagicMock())
        plot(fig)
        written.update(name=name, figures=figures, config=config)

    monkeypatch.setattr(cli, "write_results", fake_write)
    spec = cli.load_spec(cli.DEFAULT_PARAMS)
    spec["workload"].update(train_batch_size=8, n=4, max_response_length=2000, response_median=400)
    spec["cluster"].update(gpus=[4], headline_gpus=4, headline_lag=1, lags=[0, 1])
    spec["run"]["quick"].update(gpus=[4], steps=3)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(spec))
    cli.main(["--quick", "--params", str(path), "--out", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"simulate async\(lag 1\)/sync speedup, balanced 4 GPUs: [\d.]+", last)
    assert written["name"] == "simulate"
    rows = written["figures"]["rows"]
    assert {r["lag"] for r in rows} == {0, 1}
    assert all(r["ratio_to_ideal"] <= 1.03 and r["samples_per_s"] > 0 for r in rows)
    assert json.dumps(written["figures"])  # JSON-ready
