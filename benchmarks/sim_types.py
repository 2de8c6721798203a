"""The scheduler model's inputs and outputs: response lengths, costs and cluster shape
(:class:`SimParams`), capacities alone, and one run's figures (:class:`SimResult`). Pure.

Used by :mod:`benchmarks.sim_model` (the event loop), ``benchmarks/simulate.py`` (published
parameters from ``sim_params.yaml``) and ``benchmarks/pipeline_stats.py`` (parameters
calibrated on this machine's phases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from asyncrl.control.admission import groups_per_version


@dataclass(frozen=True)
class ResponseLengths:
    """Response lengths in tokens: a lognormal (``median``, ``sigma``) clipped to
    ``[1, max_length]``, or, when ``empirical`` is given, draws from that sample.
    ``prompt_share`` is the share of the log-variance common to a group's ``n`` samples
    (hard prompts make all their samples long); 0 draws every sample independently."""

    median: float = 1000.0
    sigma: float = 0.0
    max_length: int = 32768
    prompt_share: float = 0.0
    empirical: tuple[int, ...] | None = None

    def draw(self, rng: np.random.Generator, groups: int, n: int) -> np.ndarray:
        """``groups x n`` integer lengths."""
        if self.empirical is not None:
            return rng.choice(np.asarray(self.empirical, dtype=np.int64), size=(groups, n))
        shared = rng.standard_normal((groups, 1)) * math.sqrt(self.prompt_share)
        own = rng.standard_normal((groups, n)) * math.sqrt(1.0 - self.prompt_share)
        raw = self.median * np.exp(self.sigma * (shared + own))
        return np.clip(np.rint(raw), 1, self.max_length).astype(np.int64)

    def stats(self, prompt_length: int, *, draws: int = 200_000, seed: int = 0) -> dict:
        """Moments the costs need: mean response, mean tokens per sample, the mean
        context a decode step reads (token-weighted) and the mean position a training token
        attends over."""
        lens = self.draw(np.random.default_rng(seed), max(1, draws // 16), 16).ravel()
        lens = lens.astype(np.float64)
        total = prompt_length + lens
        return {
            "mean_response": float(lens.mean()),
            "mean_sample_tokens": float(total.mean()),
            "decode_context": prompt_length + float((lens * (lens + 1) / 2).sum() / lens.sum()),
            "train_position": float((total * (total + 1) / 2).sum() / total.sum()),
            "truncated_frac": float((lens >= self.max_length).mean()),
        }


@dataclass(frozen=True)
class SimParams:
    """Everything a run needs: sizes, workload and costs (seconds, bytes).

    A calibration against measured costs builds one directly, e.g. with the response
    lengths a real run produced: ``SimParams(num_servers=1, max_num_seqs=64, n=8,
    train_batch_size=16, decode_fixed_s=..., decode_per_seq_s=..., train_s_per_token=...,
    lengths=ResponseLengths(empirical=tuple(lengths)))``, then :func:`simulate` or
    :func:`compare_lags`.
    """

    num_servers: int
    max_num_seqs: int
    n: int
    train_batch_size: int
    decode_fixed_s: float
    decode_per_seq_s: float
    train_s_per_token: float
    lengths: ResponseLengths
    prompt_length: int = 0
    prefill_s_per_token: float = 0.0
    sync_every: int = 1
    tasks_per_request: int = 4
    train_fixed_s: float = 0.0
    learner_gpus: int = 1
    learner_efficiency: float = 1.0
    weight_bytes: float = 0.0
    sync_bandwidth: float = math.inf
    sync_fixed_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < self.n:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} below n={self.n}: no group fits")
        if min(self.num_servers, self.n, self.train_batch_size, self.learner_gpus) < 1:
            raise ValueError("num_servers, n, train_batch_size and learner_gpus must be >= 1")
        groups_per_version(self.train_batch_size, self.sync_every)  # validates both

    def t_step(self, b: int) -> float:
        """Seconds for one decode step of ``b`` sequences."""
        return self.decode_fixed_s + self.decode_per_seq_s * b

    @property
    def learner_speed(self) -> float:
        """Learner GPUs in single-GPU equivalents (linear, times the efficiency factor)."""
        return 1.0 if self.learner_gpus == 1 else self.learner_gpus * self.learner_efficiency

    @property
    def sync_s(self) -> float:
        return self.sync_fixed_s + self.weight_bytes / self.sync_bandwidth


def generation_capacity(p: SimParams, mean_response: float) -> float:
    """Samples/s of the rollout servers alone: always a full batch, never paused."""
    per_sample = mean_response * p.t_step(p.max_num_seqs) / p.max_num_seqs
    per_sample += p.prompt_length * p.prefill_s_per_token / p.n
    return p.num_servers / per_sample


def training_capacity(p: SimParams, mean_sample_tokens: float) -> float:
    """Samples/s of the learner alone: back-to-back steps, no sync, no wait."""
    samples = p.train_batch_size * p.n
    step_s = p.train_s_per_token * samples * mean_sample_tokens + p.train_fixed_s
    return samples * p.learner_speed / step_s


@dataclass
class SimResult:
    """Figures of one run over its measured window (after warm-up). Rates per second of
    virtual time; fractions of the window."""

    max_policy_lag: int
    steps: int
    window_s: float
    samples_per_s: float
    generated_tokens_per_s: float
    trained_tokens_per_s: float
    learner_wait_frac: float
    rollout_wait_frac: float
    rollout_util: float
    mean_lag: float
    max_lag: int
    lag_hist: dict[int, int]
    drops_lag: int
    drop_frac: float
    max_budget_excess: int
    gen_capacity_samples_per_s: float
    train_capacity_samples_per_s: float
    ideal_tokens_per_s: float
    ratio_to_ideal: float
    step_times: list[float] = field(default_factory=list)
    ratio_to_sync: float | None = None


def with_split(params: SimParams, rollout_gpus: int, learner_gpus: int) -> SimParams:
    """The same workload and costs on another split (one rollout server per GPU)."""
    return replace(params, num_servers=rollout_gpus, learner_gpus=learner_gpus)
