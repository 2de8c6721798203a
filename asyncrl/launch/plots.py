"""The run's plots (``progress.png``): reward and validation score vs step and time,
throughput, the lag of what was trained on, and a critic's value loss; drawn from the
learner's records at the end of a launch, or by ``python -m asyncrl.launch.progress``."""

from __future__ import annotations

from pathlib import Path

from asyncrl.metrics import val_step, validation_rounds


def write_plots(run_dir: Path, records: list[dict[str, float]]) -> list[Path]:
    """``progress.png``, titled with the run: reward and validation score vs step and vs
    time, throughput, the lag of what was trained on (the lags that occurred), and for a
    run with a critic its value loss and explained variance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = records[0].get("time", 0.0)
    critic = any("critic/vf_loss" in r for r in records)
    fig, axes = plt.subplots(2, 3 if critic else 2, figsize=(16 if critic else 11, 7))
    run = Path(run_dir).resolve()
    fig.suptitle(f"{run.parent.name}/{run.name}")
    rounds = validation_rounds(records)  # at the step of the weights each measured
    for key, label in (("reward/mean", "reward"), ("val/score", "validation score")):
        shown = rounds if key == "val/score" else [r for r in records if key in r]
        pts = [(val_step(r), r.get("time", t0) - t0, r[key]) for r in shown]
        if pts:
            axes[0][0].plot([p[0] for p in pts], [p[2] for p in pts], "o-", ms=3, label=label)
            axes[0][1].plot([p[1] for p in pts], [p[2] for p in pts], "o-", ms=3, label=label)
    axes[0][0].set(xlabel="learner step", title="score vs step")
    axes[0][1].set(xlabel="seconds", title="score vs time")
    for ax in axes[0][:2]:
        ax.legend()
    tput = [(r["step"], r["perf/tokens_per_s"]) for r in records if "perf/tokens_per_s" in r]
    axes[1][0].plot([p[0] for p in tput], [p[1] for p in tput])
    axes[1][0].set(xlabel="learner step", ylabel="tokens/s", title="training throughput")
    lags = lag_counts(records)
    axes[1][1].bar(list(lags), list(lags.values()))
    axes[1][1].set(xlabel="policy lag (versions)", ylabel="responses", title="lag of trained data")
    axes[1][1].set_xticks(list(lags), lag_labels(list(lags), records))
    if critic:
        for ax, key, title in (
            (axes[0][2], "critic/vf_loss", "critic value loss"),
            (axes[1][2], "critic/vf_explained_var", "critic explained variance"),
        ):
            pts = [(r["step"], r[key]) for r in records if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts])
            ax.set(xlabel="learner step", title=title)
    fig.tight_layout()
    path = Path(run_dir) / "progress.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


LAG_HIST = "lag/hist_"


def _lag_bucket(key: str) -> tuple[int, bool] | None:
    """(lag, whether the bucket holds that lag or more) of a ``lag/hist_*`` key:
    ``lag/hist_3`` is (3, False), the histogram's last bucket ``lag/hist_ge8`` (8, True)."""
    if not key.startswith(LAG_HIST):
        return None
    suffix = key[len(LAG_HIST) :]
    open_ended = suffix.startswith("ge")
    digits = suffix[2:] if open_ended else suffix
    return (int(digits), open_ended) if digits.isdigit() else None


def lag_counts(records: list[dict[str, float]]) -> dict[int, float]:
    """Responses trained on, by policy lag, over the run (``lag/hist_<k>``; the last
    bucket's, ``lag/hist_ge<k>``, at ``k``: :func:`lag_labels` names it "k+"); only the
    lags that occurred, so the axis ends at the largest lag seen, not at the histogram's
    width."""
    lags: dict[int, float] = {}
    for r in records:
        for key, v in r.items():
            if (bucket := _lag_bucket(key)) is not None:
                lags[bucket[0]] = lags.get(bucket[0], 0) + v
    return {lag: n for lag, n in sorted(lags.items()) if n} or {0: 0.0}


def lag_labels(lags: list[int], records: list[dict[str, float]]) -> list[str]:
    """The bar labels of ``lags``: "8+" for the bucket of lags 8 and more."""
    open_ended = {b[0] for r in records for key in r if (b := _lag_bucket(key)) and b[1]}
    return [f"{lag}+" if lag in open_ended else str(lag) for lag in lags]
