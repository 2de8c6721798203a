"""The admission rule (docs/DESIGN.md sections 4 and 10). Pure: no I/O, no clock.

A training task may be dealt only while ``committed < consumed + (max_policy_lag + 1) * G``:

- ``G = data.train_batch_size * staleness.sync_every``: groups the learner consumes per
  policy version;
- ``committed``: training deals still charged, i.e. outstanding at a server, in the buffer,
  or trained (the ledger counts them; a task taken back, dropped unused or given up is no
  longer charged, so the budget never leaks);
- ``consumed``: training groups the learner had trained on when it pushed the weights that
  are current now. With ``staleness.deal_at_send`` it moves when the broadcast of the next
  weights ends, before the members report (:meth:`Budget.sent`): a task dealt from then on
  carries the version being loaded (:attr:`Budget.deal_version`), and its server waits
  until it has loaded that version before generating it, so the group is generated under
  the weights its window assumed.

So the servers may run at most ``max_policy_lag + 1`` versions' worth of groups ahead of what
the current weights have consumed, and a group dealt now is trained within
``max_policy_lag`` versions: lag is bounded without throwing work away.

The window is kept in groups consumed, not in version numbers, on purpose: a version can
move without consumption (the push of restored weights after a learner restart, a server
registering with a higher version than a restored coordinator), and none of those may widen
the window. The original form, ``dealt < (max_policy_lag + v + 1) * G``, is the special case
``consumed = v * G``. Validation tasks are outside the budget. Versions never go backwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def groups_per_version(train_batch_size: int, sync_every: int) -> int:
    """Groups the learner consumes per policy version."""
    if train_batch_size < 1 or sync_every < 1:
        raise ValueError("train_batch_size and sync_every must be at least 1")
    return train_batch_size * sync_every


def push_due(step: int, sync_every: int, total: int) -> bool:
    """Whether the learner pushes its weights after ``step``: every ``sync_every`` steps
    and after the last one."""
    return step % sync_every == 0 or step == total


def weights_step(step: int, sync_every: int, total: int) -> int:
    """The learner step whose weights the servers hold once the pushes up to ``step`` have
    ended: ``step`` when it pushed, else the last step before it that did (``sync_every``
    not dividing ``trainer.test_freq``). After a learner restart from a checkpoint of a
    step that did not push, the servers that lived on hold that last push's weights still
    (under the version the checkpoint carries), so it is that step too."""
    if push_due(step, sync_every, total):
        return step
    return step - step % sync_every


def replayed_version(version: int, step: int, redelivered: int, sync_every: int, total: int) -> int:
    """The version a learner restored at ``step``/``version`` reaches by training the
    ``redelivered`` batches again (the ones its previous life trained after the checkpoint):
    versions follow the push schedule, so the replay reaches the versions that life pushed.
    """
    last = min(step + redelivered, total)
    return version + sum(push_due(s, sync_every, total) for s in range(step + 1, last + 1))


def budget_limit(consumed: int, max_policy_lag: int, per_version: int) -> int:
    """How many training tasks may be committed in total once ``consumed`` were trained."""
    return consumed + (max_policy_lag + 1) * per_version


def grantable(committed: int, consumed: int, max_policy_lag: int, per_version: int) -> int:
    """How many more training tasks the rule admits now (never negative)."""
    return max(0, budget_limit(consumed, max_policy_lag, per_version) - committed)


@dataclass
class Budget:
    """The admission state of a run: the current version and the consumption it stands for.

    ``committed`` is not kept here: the ledger derives it from the state of every task, so
    a refund can never be forgotten or counted twice.
    """

    max_policy_lag: int
    per_version: int
    version: int = 0
    consumed: int = 0  # training groups trained on by the weights of ``version``
    # The version whose weights were sent and are being loaded (not checkpointed: a
    # restored run pushes again). Tasks dealt from the send on carry it, and their server
    # waits until it has loaded it (rollout_servers.engine.RolloutEngine.reach).
    sent_version: int = 0

    @property
    def limit(self) -> int:
        return budget_limit(self.consumed, self.max_policy_lag, self.per_version)

    def free(self, committed: int) -> int:
        return grantable(committed, self.consumed, self.max_policy_lag, self.per_version)

    def advance(self, version: int) -> None:
        """Move to ``version`` (no consumption implied); going back is a bug (ValueError)."""
        if version < self.version:
            raise ValueError(f"policy_version cannot go back from {self.version} to {version}")
        self.version = version

    def consume(self, consumed: int) -> None:
        """The current weights have trained on ``consumed`` groups in all (a push)."""
        self.consumed = max(self.consumed, consumed)

    def sent(self, version: int, consumed: int) -> None:
        """The weights of ``version``, trained on ``consumed`` groups, were sent to every
        member of the push: the window moves now rather than when the members' reports
        close the round (after each has loaded them and scored the post-sync probe, 0.1-0.3
        s later on the CPU demo)."""
        self.consume(consumed)
        self.sent_version = max(self.sent_version, version)

    @property
    def deal_version(self) -> int:
        """The version a task dealt now is stamped with (``Task.dealt_version``): the one
        being loaded once its weights were sent, else the current one."""
        return max(self.version, self.sent_version)

    def metrics(self, committed: int) -> dict[str, float]:
        return {
            "coordinator/budget/dealt": float(committed),
            "coordinator/budget/consumed": float(self.consumed),
            "coordinator/budget/limit": float(self.limit),
            "coordinator/budget/free": float(self.free(committed)),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        # A checkpoint of the version-based rule: the consumption its version stood for.
        self.consumed = int(state.get("consumed", self.version * self.per_version))
