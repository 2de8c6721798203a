"""Does a test fail when the feature it claims breaks? Each mutation below breaks one
recovery or correctness feature in a scratch worktree of ``HEAD`` (one line replaced) and
runs the tests named for it; the feature counts as caught when at least one of them fails.

Run from the repository root (prints the table ``tests/README.md`` records; a few minutes)::

    .venv/bin/python -m tests.mutation_check            # every mutation
    .venv/bin/python -m tests.mutation_check lag dedup  # those whose name contains a word

Exit status 1 when a mutation was not caught (or its line is gone: update the list), so a
new feature's row can be added here and checked the same way. Not collected by pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    feature: str
    broken: str  # what the mutation does, in words
    path: str
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]


T_RECOVERY = "tests/test_recovery_faults.py"
MUTATIONS = (
    Mutation(
        "replay after a learner restart",
        "a replayed version is never adopted (always pushed again)",
        "asyncrl/control/versions.py",
        "        if replay is None or not self.version < version <= replay:",
        "        if True:",
        ("tests/test_accounting.py::test_a_learner_restart_loses_nothing_and_repeats_nothing",),
    ),
    Mutation(
        "re-deal after a NACK",
        "a failed task is neither dealt again nor given up",
        "asyncrl/control/ledger.py",
        "            back += self._fail(tid, e, cause)",
        "            pass",
        ("tests/test_accounting.py",),
    ),
    Mutation(
        "lag filter",
        "the buffer never drops stale groups",
        "buffer/core.py",
        "        self._drop_stale(version)",
        "        pass",
        ("tests/test_buffer_core.py",),
    ),
    Mutation(
        "dedup of a task's groups",
        "a group of a closed task id is taken again",
        "buffer/assembly.py",
        "        if closed is not None:",
        "        if False:",
        ("tests/test_buffer_core.py",),
    ),
    Mutation(
        "admission budget",
        "admission grants without limit",
        "asyncrl/control/admission.py",
        "    return max(0, budget_limit(consumed, max_policy_lag, per_version) - committed)",
        "    return 10**9",
        ("tests/test_admission.py",),
    ),
    Mutation(
        "importance weights",
        "the weights are not truncated at the cap (tis)",
        "learner/losses.py",
        "        applied = raw.clamp(max=cap)",
        "        applied = raw",
        ("tests/test_losses.py",),
    ),
    Mutation(
        "masked spans of multi-turn samples",
        "tool and user tokens enter the loss",
        "learner/collate.py",
        "        mask[b, :n_r] = True if r.loss_mask is None else torch.as_tensor(r.loss_mask) != 0",
        "        mask[b, :n_r] = True",
        ("tests/test_loss_mask.py",),
    ),
    Mutation(
        "token-in/token-out turns",
        "every turn is re-rendered (a new sample)",
        "rollout_servers/agent.py",
        "    tail = continuation(piece.prompt_ids + piece.token_ids, before, after)",
        "    tail = None",
        ("tests/test_endpoint_faults.py",),
    ),
    Mutation(
        "ids of a fresh coordinator (F1)",
        "a coordinator without a checkpoint deals the ids of the one before",
        "asyncrl/control/task_source.py",
        "        self.lineage = secrets.token_hex(3) if lineage is None else lineage",
        '        self.lineage = "" if lineage is None else lineage',
        (T_RECOVERY,),
    ),
    Mutation(
        "duplicate of a forgotten group reported (F1)",
        "the buffer drops it silently (its charge stays)",
        "buffer/assembly.py",
        '        if closed == "complete" and tid not in s.held and not traj.validation:',
        "        if False:",
        (T_RECOVERY,),
    ),
    Mutation(
        "endpoint slots of a dead line (fault simulation)",
        "a fresh ledger takes back any session's external slot",
        "asyncrl/control/ledger.py",
        "        return parts[1] == self.session or parts[1] in self.earlier_sessions",
        "        return True",
        (T_RECOVERY,),
    ),
    Mutation(
        "batch ids per buffer session (F1b)",
        "an acked_through of another session acknowledges this one's batches",
        "buffer/deliveries.py",
        "        if acked_through is not None and session == self.session:",
        "        if acked_through is not None:",
        (T_RECOVERY,),
    ),
    Mutation(
        "acknowledgements per buffer session",
        "an acknowledgement of another session's batch ids forgets this one's",
        "buffer/core.py",
        "        if session is not None and session != self.session:",
        "        if False:",
        ("tests/test_buffer_service.py",),
    ),
    Mutation(
        "per-server pacing",
        "a server whose groups go stale keeps being dealt as many",
        "asyncrl/control/pacing.py",
        "        if cap > 1 and self.outlier(server_id):",
        "        if False:",
        ("tests/test_pacing.py",),
    ),
    Mutation(
        "the window opens at the send",
        "deals wait for the members' reports again",
        "asyncrl/control/versions.py",
        '        self.ledger.budget.sent(active.round.version, self.ledger.tally["train"][DONE])',
        "        return",
        ("tests/test_admission_registry.py",),
    ),
    Mutation(
        "staleness.deal_at_send reaches the coordinator",
        "the pusher never opens the window at the send",
        "asyncrl/sync/sender.py",
        "        if not error and self.deal_at_send:",
        "        if False:",
        ("tests/test_weight_sync.py",),
    ),
    Mutation(
        "a task waits for the version it was dealt at",
        "a task dealt at the send starts under the weights before",
        "rollout_servers/engine.py",
        "        if self.version >= version:",
        "        if True:",
        ("tests/test_engine_versions.py",),
    ),
    Mutation(
        "external slot ids per incarnation (F2)",
        "slot ids are plain serials again",
        "asyncrl/control/task_states.py",
        '    return f"{EXTERNAL}{session}/{serial}" if session else f"{EXTERNAL}{serial}"',
        '    return f"{EXTERNAL}{serial}"',
        (T_RECOVERY,),
    ),
    Mutation(
        "replay pushes a version nobody holds (F4)",
        "a replayed version is adopted whether or not a server holds it",
        "asyncrl/control/versions.py",
        "        if not any(r.trusted and r.policy_version >= version for r in self.servers.values()):",
        "        if False:",
        (T_RECOVERY,),
    ),
    Mutation(
        "late batch reply (F5)",
        "a batch whose reply was lost is not sent again",
        "buffer/deliveries.py",
        "        if received is None:\n            return None",
        "        if True:\n            return None",
        ("tests/test_buffer_replies.py",),
    ),
    Mutation(
        "late drop report (F5)",
        "drop reports are drained (a lost reply loses them)",
        "buffer/reports.py",
        "        return self.drops[drops_from:], self.validated[validated_from:]",
        "        out = self.drops[drops_from:], self.validated[validated_from:]\n"
        "        self.drops, self.validated = [], []\n"
        "        return out",
        ("tests/test_buffer_replies.py",),
    ),
    Mutation(
        "incomplete groups beyond capacity (F6)",
        "new groups are taken without limit inside a message",
        "buffer/assembly.py",
        "            if len(s.partial) >= self.capacity:",
        "            if False:",
        ("tests/test_buffer_replies.py",),
    ),
    Mutation(
        "one request id per call (F3)",
        "concurrent calls share a request id",
        "asyncrl/control/request_ids.py",
        "            self._next += 1",
        "            pass",
        ("tests/test_client_requests.py",),
    ),
    Mutation(
        "per-role authority (S1)",
        "every role may send every request",
        "asyncrl/net/serving.py",
        "            if self.policy is not None and not self.policy.permits(role, msg.kind):",
        "            if False:",
        ("tests/test_authority.py",),
    ),
    Mutation(
        "idle endpoint groups give their slot back",
        "an idle group is never closed (its slot is held forever)",
        "rollout_servers/endpoint_groups.py",
        "                if not busy and now - group.last_active > self.idle_s:",
        "                if False:",
        ("tests/test_endpoint_slots.py",),
    ),
    Mutation(
        "a refused first request holds no slot",
        "a group whose first request was refused keeps its slot",
        "rollout_servers/endpoint_groups.py",
        '        self.close(group, "given back: its first request was refused or failed")',
        "        pass",
        ("tests/test_endpoint_slots.py",),
    ),
    Mutation(
        "a launch claims its ports",
        "a taken default port is used anyway",
        "asyncrl/launch/ports.py",
        "        if taken:",
        "        if False:",
        ("tests/test_launch_ports.py",),
    ),
    Mutation(
        "health alarms",
        "the effective sample size is never checked",
        "learner/health.py",
        '            _outside(m, "min_ess", "importance/ess", c.min_ess, None, STALE),',
        "",
        ("tests/test_health.py",),
    ),
    Mutation(
        "adaptive staleness narrows at once",
        "a degraded correction waits out the hold like a widening",
        "asyncrl/control/lag_controller.py",
        "        if lag > self.lag and step - self.widened_at < HOLD_STEPS:",
        "        if step - self.widened_at < HOLD_STEPS:",
        ("tests/test_lag_controller.py",),
    ),
    Mutation(
        "dual clip",
        "negative-advantage tokens are not bounded at clip_ratio_c",
        "learner/losses.py",
        "        loss_t = torch.where(adv < 0, torch.minimum(loss_t, bound), loss_t)",
        "        pass",
        ("tests/test_losses_recipes.py",),
    ),
    Mutation(
        "GSPO's sequence ratio",
        "GSPO uses each token's own ratio",
        "learner/losses.py",
        "        ratio = (logprobs - logprobs.detach() + seq).clamp(max=_GSPO_LOG_RATIO_MAX).exp()",
        "        ratio = log_ratio.exp()",
        ("tests/test_losses_recipes.py",),
    ),
    Mutation(
        "group filter at the server",
        "a group whose members score alike is pushed anyway",
        "rollout_servers/groups.py",
        "    return not has_signal(values)",
        "    return False",
        ("tests/test_filter_groups.py",),
    ),
    Mutation(
        "filtered groups leave the budget",
        "a filtered group stays charged (in the buffer, as if pushed)",
        "asyncrl/control/ledger.py",
        '            self.move(tid, e, "dropped/filtered", "filtered")',
        "            self.move(tid, e, BUF)",
        ("tests/test_filter_groups.py",),
    ),
    Mutation(
        "max_num_gen_batches",
        "the filter never stops (tasks are dealt filtered past the bound)",
        "asyncrl/control/group_filter.py",
        "        return self.enable and not (self.bound and self.since_step >= self.bound)",
        "        return self.enable",
        ("tests/test_filter_groups.py",),
    ),
    Mutation(
        "skipped prompts come back",
        "a prompt's filtered streak is never reset when its group trains",
        "asyncrl/control/prompt_skip.py",
        "            self.streak.pop(row, None)",
        "            pass",
        ("tests/test_prompt_skip.py",),
    ),
    Mutation(
        "held endpoint requests keep max_groups",
        "slot requests in flight do not count against max_groups",
        "rollout_servers/slot_wait.py",
        "            if self.open_groups() + self._reserved < self.max_groups:",
        "            if self.open_groups() < self.max_groups:",
        ("tests/test_endpoint_hold.py",),
    ),
    Mutation(
        "the inline engine's pause",
        "the engine thread steps requests while paused for a weight load",
        "rollout_servers/inline_llm.py",
        "        return not self._paused and self._engine.has_unfinished_requests()",
        "        return self._engine.has_unfinished_requests()",
        ("tests/test_inline_llm.py",),
    ),
    Mutation(
        "a dead inline engine fails its waiters",
        "requests waiting on an engine whose step raised are left waiting",
        "rollout_servers/inline_llm.py",
        "        self._to_loop(self._fail_waiting, error)",
        "        pass",
        ("tests/test_inline_llm.py",),
    ),
    Mutation(
        "the sync store listens at endpoints.host only",
        "the store's server listens on every interface (torch's own)",
        "asyncrl/sync/weights.py",
        "        fd = _listening_fd(host, port) if is_host else None",
        "        fd = None",
        ("tests/test_weight_sync.py::test_the_sync_store_listens_at_the_configured_host_only",),
    ),
    Mutation(
        "health history in the checkpoint",
        "a restored monitor starts with an empty entropy window",
        "learner/health.py",
        '        self.entropies.extend(float(x) for x in state.get("entropies", []))',
        "        pass",
        ("tests/test_health.py",),
    ),
    Mutation(
        "a fixed KL coefficient is the config's on resume",
        "the checkpoint's coefficient overrides a fixed one",
        "learner/reward_kl.py",
        '        if REWARD_KL_KEY not in extra or self.ctrl.kind != "adaptive":',
        "        if REWARD_KL_KEY not in extra:",
        ("tests/test_resume_settings.py",),
    ),
    Mutation(
        "event totals survive a resume",
        "the ledger's counters restart at 0",
        "asyncrl/control/ledger_checkpoint.py",
        '    ledger.counts.update({k: int(v) for k, v in state.get("counts", {}).items()})',
        "    pass",
        ("tests/test_admission_registry.py",),
    ),
    Mutation(
        "a broken scorer pool ends the server",
        "a server whose reward workers cannot be replaced goes on failing tasks",
        "rollout_servers/server.py",
        "                self.fatal = self.fatal or str(e)",
        "                pass",
        ("tests/test_rollout_mends.py",),
    ),
    Mutation(
        "sync groups known by session",
        "a restarted learner's group of the same generation counts as joined",
        "rollout_servers/server.py",
        "        if (start.session, start.generation) == self.generation:",
        "        if start.generation == self.generation[1]:",
        ("tests/test_rollout_mends.py",),
    ),
    Mutation(
        "a failed sample cancels its group",
        "the group's other samples keep generating",
        "rollout_servers/task_groups.py",
        "            t.cancel()",
        "            pass",
        ("tests/test_rollout_mends.py",),
    ),
    Mutation(
        "a new run's launch sets the old records aside",
        "the launcher leaves an earlier run's metrics on view",
        "asyncrl/launch/roles.py",
        "    if new_run(cfg):  # the learner would too, but one that fails first left them on view",
        "    if False:",
        ("tests/test_launch_progress.py",),
    ),
)


def _run(m: Mutation) -> tuple[str, float]:
    """Apply ``m`` in a scratch worktree and run its tests: (the outcome, seconds)."""
    with tempfile.TemporaryDirectory(prefix="mutant-") as scratch:
        tree = Path(scratch) / "tree"
        git = ["git", "-C", str(ROOT)]
        subprocess.run([*git, "worktree", "add", "--detach", "-q", str(tree), "HEAD"], check=True)
        try:
            target = tree / m.path
            text = target.read_text()
            if text.count(m.old) != 1:
                return "line not found (update the mutation)", 0.0
            target.write_text(text.replace(m.old, m.new))
            env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
            start = time.monotonic()
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            took = time.monotonic() - start
            failed = [
                ln
                for ln in proc.stdout.splitlines()
                if ln.startswith(("FAILED tests/", "ERROR tests/"))
            ]
            if proc.returncode == 0:
                return "NOT CAUGHT", took
            return (failed[0].split(" - ")[0] if failed else f"exit {proc.returncode}"), took
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(tree)], check=False)


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not argv or any(w in m.feature for w in argv)]
    print("| feature | what was broken | test that failed | seconds |")
    print("|---|---|---|---|")
    missed = 0
    for m in chosen:
        outcome, took = _run(m)
        missed += outcome.startswith(("NOT CAUGHT", "line not found"))
        print(f"| {m.feature} | {m.broken} | {outcome} | {took:.0f} |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
