"""Progress people can read: a live line while a job runs, a summary and plots at the end.

Everything comes from the learner's ``<run dir>/metrics.jsonl`` (see
:mod:`asyncrl.metrics`) and the launcher's ``<run dir>/launch.jsonl`` (restarts per role,
see :mod:`asyncrl.launch.supervise`), so the view works for a job started by hand too
(``python -m asyncrl.launch.progress RUN_DIR`` draws the summary and plots of any run).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from asyncrl.config import Config
from asyncrl.config.inputs import total_training_steps
from asyncrl.launch import startup
from asyncrl.launch.plots import write_plots
from asyncrl.launch.time_split import time_split
from asyncrl.metrics import REACHED, MetricsTail, read_metrics, validation_rounds

# (label, metric, format) of the live line and the summary.
LIVE = [
    ("step", "step", "{:.0f}"),
    ("version", "actor/policy_version", "{:.0f}"),
    ("reward", "reward/mean", "{:.3f}"),
    ("val", "val/score", "{:.3f}"),
    ("lag", "lag/mean", "{:.2f}"),
    ("train tok/s", "perf/tokens_per_s", "{:.0f}"),
    ("gen tok/s", "rollout/tokens_per_s", "{:.0f}"),
    ("learner wait", "timing/wait_fraction", "{:.0%}"),
    ("rollout wait", "rollout/wait_fraction", "{:.0%}"),
]
CUT = "rollout/prompts_truncated"
SCORER_SHOWN = 0.05  # the servers' share of time idle on the scorer the live line shows

# The summary's rows: the waits are left out, since one step's share (the first is mostly
# start-up) misleads at the end; the time split after the table gives them over the run.
SUMMARY = [row for row in LIVE[1:] if not row[1].endswith("wait_fraction")]


def _fmt(fmt: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def last_value(records: list[dict[str, float]], key: str) -> float | None:
    for r in reversed(records):
        if key in r:
            return r[key]
    return None


#: The servers' figures of now (rates and shares), not counts: while no server reports they
#: are unknown, not the last ones an older record holds.
SERVER_RATES = ("rollout/tokens_per_s", "rollout/wait_fraction", "rollout/score_wait_fraction")


def _live_value(records: list[dict[str, float]], key: str) -> float | None:
    """``key``'s latest value for the live line: the score of the round of the newest
    weights (rounds complete out of order); None for :data:`SERVER_RATES` while the latest
    record to say so has ``rollout/servers_reporting`` 0 (every server down or restarting:
    those records leave the rates out)."""
    if key in SERVER_RATES and last_value(records, "rollout/servers_reporting") == 0:
        return None
    if key == "val/score":  # the round of the newest weights, whenever it completed
        rounds = validation_rounds(records)
        return rounds[-1][key] if rounds else None
    return last_value(records, key)


def read_restarts(run_dir: Path) -> dict[str, int]:
    """Restarts per role in the latest launch (``launch.jsonl``), every started role listed;
    empty for a run started by hand."""
    path = Path(run_dir) / "launch.jsonl"
    if not path.exists():
        return {}
    counts: dict[str, int] = {}
    for raw in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(raw)
        except ValueError:  # a line being written
            continue
        kind, role = event.get("event"), event.get("role", "?")
        if kind == "launch":  # a new launch in the same run directory starts over
            counts = {}
        elif kind == "start":
            counts.setdefault(role, 0)
        elif kind == "restart":
            counts[role] = int(event.get(f"launch/restarts/{role}", counts.get(role, 0) + 1))
    return counts


def read_launches(run_dir: Path) -> list[float]:
    """When each launch in the run directory began (the times of ``launch.jsonl``'s
    ``launch`` events), oldest first; empty for a run started by hand."""
    path = Path(run_dir) / "launch.jsonl"
    if not path.exists():
        return []
    starts = []
    for raw in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(raw)
        except ValueError:  # a line being written
            continue
        if event.get("event") == "launch" and isinstance(event.get("time"), int | float):
            starts.append(float(event["time"]))
    return sorted(starts)


def launch_records(
    records: list[dict[str, float]], starts: list[float]
) -> tuple[int, list[dict[str, float]]]:
    """The records of the latest launch that wrote any, and its number (1 for the first of
    ``starts``); (0, every record) without launches. A resumed run's earlier launches are
    its curve, but their downtime is no role's time (and a launch that resumed no
    checkpoint counts the servers' counters from 0 again), so a summary over them mixes
    launches."""
    ends = [*starts[1:], math.inf]
    for k in range(len(starts), 0, -1):
        mine = [r for r in records if starts[k - 1] <= r.get("time", -math.inf) < ends[k - 1]]
        if mine:
            return k, mine
    return 0, records


def launch_line(k: int, n: int, records: list[dict[str, float]]) -> str:
    """Which launch of a run launched ``n`` times the summary below is of."""
    steps = [r["step"] for r in records if "step" in r]
    span = f"steps {min(steps):.0f}-{max(steps):.0f}" if steps else "no step"
    latest = "the latest" if k == n else f"the latest with a step record; {n} wrote none"
    return (
        f"launch {k} of {n} ({latest}, {span}): the table and the time split are this "
        "launch's; the accounting and the plots cover the whole run"
    )


def accounting_line(metrics: dict[str, float], kind: str = "train") -> str | None:
    """One line saying where every task of ``kind`` (``train``, ``val``) dealt so far is,
    from a record with ``accounting/<kind>/*`` keys; None without them. For example
    ``accounting train: dealt 960 = in flight 0 + in buffer 12 + trained 940 + dropped 8
    (lag 8) + given up 0``, with ``; unaccounted N`` appended when the parts do not add up."""
    p = f"accounting/{kind}/"
    if p + "dealt" not in metrics:
        return None
    done = "scored" if kind == "val" else "trained"
    drops = {
        k[len(p + "dropped/") :]: v for k, v in metrics.items() if k.startswith(p + "dropped/")
    }
    reasons = ", ".join(f"{reason} {n:.0f}" for reason, n in sorted(drops.items()) if n)
    line = (
        f"accounting {kind}: dealt {metrics[p + 'dealt']:.0f} = "
        f"in flight {metrics.get(p + 'in_flight', 0):.0f} + "
        f"in buffer {metrics.get(p + 'in_buffer', 0):.0f} + "
        f"{done} {metrics.get(p + done, 0):.0f} + "
        f"dropped {sum(drops.values()):.0f}{f' ({reasons})' if reasons else ''} + "
        # An external slot is never dealt again: one unused or lost is given back.
        f"{'given back' if kind == 'external' else 'given up'} "
        f"{metrics.get(p + 'given_up', 0):.0f}"
    )
    if metrics.get(p + "prompts_out_of_lag_retries", 0):
        # Each lag retry is a new id: a prompt out of retries is among the lag drops.
        n = metrics[p + "prompts_out_of_lag_retries"]
        line += f" ({n:.0f} prompts out of staleness.lag_retries, among the lag drops)"
    if kind == "external":
        line += " (the OpenAI endpoint's groups; part of train)"
    if metrics.get(p + "unaccounted", 0):
        line += f"; unaccounted {metrics[p + 'unaccounted']:.0f}"
    return line


def accounting_lines(records: list[dict[str, float]]) -> list[str]:
    """The accounting line of each kind, from the last record that has its keys (a run
    that dealt no validation task has no validation line)."""
    lines = []
    for kind in ("train", "val", "external"):
        key = f"accounting/{kind}/dealt"
        record = next((r for r in reversed(records) if key in r), None)
        if record is not None and (kind == "train" or record[key]):
            lines.append(accounting_line(record, kind))
    return lines


def reward_errors_line(records: list[dict[str, float]]) -> list[str]:
    """Lines for samples the run changed behind the user's back: the scorer failed on them
    (each scored 0.0: a run can end "finished" on rewards that are mostly failures), or
    their prompt was cut to ``data.max_prompt_length``. Counts as of the last record."""
    out = []
    if errors := last_value(records, "rollout/reward_errors"):
        out.append(
            f"reward errors: {errors:.0f} samples scored 0.0 because the scorer failed on them "
            "(rollout/reward_errors, by the last step); each server's log names the first of "
            "each kind with its fix"
        )
    if cut := last_value(records, "rollout/prompts_truncated"):
        out.append(
            f"prompts cut: {cut:.0f} prompts were longer than data.max_prompt_length and lost "
            "tokens (data.truncation; rollout/prompts_truncated): raise the limit, or set "
            "data.filter_overlong_prompts=true to drop them"
        )
    return out


def eta_s(records: list[dict[str, float]], total: int | None) -> float:
    """Seconds to step ``total`` at the pace of the steps trained so far (NaN before two
    steps): start-up (engines loading, a first validation) is not a step's pace. A step's
    record is the one with its time: a critic's warmup step or one with nothing to train
    has no ``loss/*`` (the ETA read "-" through ``trainer.critic_warmup``)."""
    steps = {}
    for r in records:
        if "timing/step_s" in r and "time" in r:
            steps.setdefault(r["step"], r["time"])
    if len(steps) < 2 or not total:
        return float("nan")
    (s0, t0), (s1, t1) = min(steps.items()), max(steps.items())
    return max(0.0, (total - s1) * (t1 - t0) / max(s1 - s0, 1e-9))


class ProgressView:
    """A live status line with a progress bar and ETA, redrawn on each :meth:`update`."""

    def __init__(self, run_dir: Path, cfg: Config, stream: TextIO | None = None):
        self.run_dir = Path(run_dir)
        self.total = total_training_steps(cfg)
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        # Records from before this launch (a run resumed, maybe hours later) are the run's
        # curve, but not this launch's pace or where its time went.
        self.launched = time.time()
        self.tty = self.stream.isatty()
        self._last_line = ""
        self._last_print = 0.0
        self._records = MetricsTail(self.run_dir)

    def line(self, records: list[dict[str, float]], restarts: dict[str, int] | None = None) -> str:
        step = last_value(records, "step") or 0
        frac = min(step / self.total, 1.0) if self.total else 0.0
        bar = "#" * int(frac * 20) + "." * (20 - int(frac * 20))
        eta = eta_s(self._this_launch(records), self.total)
        parts = [f"[{bar}] {step:.0f}/{self.total}"]
        reached = max((r.get(REACHED, 0) for r in records), default=0)
        if step < reached:  # a learner restarted from a checkpoint trains these steps again
            parts[0] += f" (again after a restart: {reached:.0f} reached)"
        parts += [f"{label} {_fmt(fmt, _live_value(records, key))}" for label, key, fmt in LIVE[1:]]
        if total := sum((restarts or {}).values()):
            parts.append(f"restarts {total}")
        scorer = _live_value(records, "rollout/score_wait_fraction") or 0.0
        if scorer >= SCORER_SHOWN:  # a slow reward function, which is not generation
            parts.append(f"scorer wait {scorer:.0%}")
        for label, key in (("reward errors", "rollout/reward_errors"), ("prompts cut", CUT)):
            if count := last_value(records, key):  # shown while it lasts, not only at the end
                parts.append(f"{label} {count:.0f}")
        parts.append(f"ETA {_fmt('{:.0f}s', eta)}")
        return " | ".join(parts)

    def update(self) -> None:
        line = self.line(self._records.read(), read_restarts(self.run_dir))
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r" + line[:200].ljust(len(self._last_line)))
            self.stream.flush()
        elif line != self._last_line and now - self._last_print > 10:
            self.stream.write(line + "\n")  # logs: a line every 10 s at most
            self._last_print = now
        self._last_line = line

    def _this_launch(self, records: list[dict[str, float]]) -> list[dict[str, float]]:
        return [r for r in records if r.get("time", 0.0) >= self.launched]

    def finish(self, ok: bool) -> None:
        if self.tty:
            self.stream.write("\n")
        records = read_metrics(self.run_dir)
        restarts = read_restarts(self.run_dir)
        table = startup.startup_table(startup.read(self.run_dir))
        if table:
            self.stream.write(table + "\n")
        for line in summary_lines(records, self._this_launch(records), restarts):
            self.stream.write(line + "\n")
        if records:
            for path in write_plots(self.run_dir, records):
                self.stream.write(f"plot: {path}\n")
        elapsed = time.monotonic() - self.started  # start-ups included
        self.stream.write(
            f"run {'finished' if ok else 'FAILED'} in {elapsed:.0f}s: {self.run_dir}\n"
        )
        self.stream.flush()


def summary_table(records: list[dict[str, float]], restarts: dict[str, int] | None = None) -> str:
    """A small table: first and last value of the headline metrics, and the restarts of
    every role the launcher started (the waits are :func:`time_split`'s, over the run)."""
    rows = [("metric", "start", "end")]
    rounds = validation_rounds(records)  # first and last by the weights each measured
    for label, key, fmt in SUMMARY:
        values = [r[key] for r in (rounds if key == "val/score" else records) if key in r]
        if values:
            rows.append((label, _fmt(fmt, values[0]), _fmt(fmt, values[-1])))
    t0, t1 = (records[0].get("time"), records[-1].get("time")) if records else (None, None)
    if t0 and t1:
        rows.append(("step 1 to end", "", f"{t1 - t0:.0f}s"))
    rows += [(f"restarts {role}", "", str(n)) for role, n in (restarts or {}).items()]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m asyncrl.launch.progress RUN_DIR``: a run's summary, accounting and
    plots, from its files (while it runs, or after)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.launch.progress",
        description="Print a run's summary table and accounting, and write its "
        "progress.png, from the files in its run directory.",
    )
    parser.add_argument(
        "run_dir", type=Path, help="the run directory: <default_local_dir>/<project>/<experiment>"
    )
    args = parser.parse_args(argv)
    directory: Path = args.run_dir
    if not directory.is_dir():
        sys.stderr.write(
            f"{parser.prog}: no run directory {directory}: give "
            "<trainer.default_local_dir>/<trainer.project_name>/<trainer.experiment_name>\n"
        )
        return 2
    recs = read_metrics(directory)
    if not recs:
        sys.stderr.write(
            f"{parser.prog}: no metrics in {directory} yet (the learner writes "
            "metrics.jsonl from its first step on)\n"
        )
        return 1
    for text in launch_summary(directory, recs):
        sys.stdout.write(text + "\n")
    sys.stdout.write(f"{write_plots(directory, recs)[0]}\n")
    return 0


def launch_summary(run_dir: Path, records: list[dict[str, float]]) -> list[str]:
    """The summary lines of a run's latest launch (as the launcher's own summary), led by
    a line naming the launch when the run was launched more than once."""
    starts = read_launches(run_dir)
    k, mine = launch_records(records, starts)
    # launch.jsonl's restarts are the latest launch's
    restarts = read_restarts(run_dir) if k == len(starts) else {}
    lines = [launch_line(k, len(starts), mine)] if len(starts) > 1 else []
    return lines + summary_lines(records, mine, restarts)


def summary_lines(
    records: list[dict[str, float]], mine: list[dict[str, float]], restarts: dict[str, int]
) -> list[str]:
    """A launch's summary: its table and time split from its own records (``mine``), the
    accounting from the whole run's (``records``)."""
    table = [summary_table(mine, restarts)] if mine or restarts else []
    return table + accounting_lines(records) + reward_errors_line(mine) + time_split(mine)


if __name__ == "__main__":
    raise SystemExit(main())
