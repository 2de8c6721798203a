"""How many tasks fit in one grant: the coordinator builds no grant its server cannot read.

A rollout server reads a reply of at most ``control.max_message_mb``
(:func:`asyncrl.control.messages.decode_reply`). Code datasets carry their tests in
``reward_model.ground_truth`` or ``extra_info``, often over 1 MB a row, so a few tasks
already pass the 4 MiB default. A grant that cannot be read strands its tasks at the server
(dealt, never generated) and ends the server's task loop; asked again, it gets the same.

So a grant takes tasks while they fit, always its first one when that one fits on its own,
and the rest wait, queued, for the next request (the grant says ``size``). The same holds
for the responses the server has room for (its request's ``max_samples``): it asks for as
many tasks as groups of ``rollout.n`` fit, and a validation group of ``val_kwargs.n`` may
be larger (always the first task, though: the server then runs it alone). A task too large
for any grant is dropped before it is dealt (``dropped/oversize`` in the accounting), with
one line naming the key that fixes it: dealt, it could never be read; kept, it would head
the queue for good.

:class:`GrantRoom` measures; the ledger (:meth:`asyncrl.control.ledger.TaskLedger.deal`)
decides what each verdict does to the task.
"""

from __future__ import annotations

import logging

from asyncrl.control.messages import DEFAULT_MAX_MESSAGE_BYTES, Task, encode

log = logging.getLogger(__name__)

#: Bytes of a grant besides its tasks (its kind, schema, version and reason take well under
#: this; a grant with tasks has no ``detail``).
GRANT_OVERHEAD = 1024
#: Bytes a task may grow by between measured and sent: its ``dealt_version`` is set when it
#: is handed (an int of up to 9 bytes); ``filter`` is a bool either way.
TASK_SLACK = 16

TAKE, FULL, TOO_LARGE = "take", "full", "too_large"
#: Tasks dropped as too large that are each named in the log (the rest are counted).
LOGGED_MAX = 5
_logged = 0  # named so far, in this process


def task_bytes(task: Task) -> int:
    """What ``task`` takes of a grant (its encoding, and room for ``dealt_version``)."""
    return len(encode(task)) + TASK_SLACK


def fits_alone(task: Task, max_bytes: int = 0) -> bool:
    """Whether a grant of ``task`` alone stays within ``max_bytes`` (0: the default)."""
    return task_bytes(task) <= (max_bytes or DEFAULT_MAX_MESSAGE_BYTES) - GRANT_OVERHEAD


class GrantRoom:
    """The bytes and responses one grant may still take, and the tasks too large for any
    grant.

    ``max_bytes`` is the coordinator's ``control.max_message_mb`` in bytes (0: its default,
    as the clients' decoders take 0); ``max_samples`` the server's free response slots (0:
    no bound)."""

    def __init__(self, max_bytes: int = 0, max_samples: int = 0) -> None:
        self.max_bytes = max_bytes or DEFAULT_MAX_MESSAGE_BYTES
        self.left = self.max_bytes - GRANT_OVERHEAD
        self.samples_left = max_samples or None
        self.taken = 0
        self.too_large: list[tuple[str, int]] = []  # (task id, its bytes), in deal order

    def admit(self, task: Task) -> str:
        """:data:`TAKE` (its bytes and responses are now spent), :data:`FULL` (not in this
        grant: the next one has room) or :data:`TOO_LARGE` (in no grant ever: recorded). The
        first task is never refused for its responses: a group larger than the server's
        slots would otherwise never be dealt (the server runs it alone)."""
        size = task_bytes(task)
        if size > self.max_bytes - GRANT_OVERHEAD:
            self.too_large.append((task.task_id, size))
            return TOO_LARGE
        if size > self.left:
            return FULL
        if self.samples_left is not None and self.taken and task.n > self.samples_left:
            return FULL
        self.left -= size
        if self.samples_left is not None:
            self.samples_left -= task.n
        self.taken += 1
        return TAKE

    def log_dropped(self) -> None:
        """One line per task dropped as too large, with the key that would let it through;
        the first :data:`LOGGED_MAX` of the process (a dataset of such rows would flood the
        log: the rest are counted, ``dropped/oversize``)."""
        global _logged
        for task_id, size in self.too_large:
            _logged += 1
            if _logged > LOGGED_MAX:
                continue
            log.error(
                "task %s is %.2f MiB, more than one grant may carry under "
                "control.max_message_mb=%g: dropped (accounted dropped/oversize); raise "
                "control.max_message_mb in the config every role reads to train on such rows",
                task_id,
                size / (1 << 20),
                self.max_bytes / (1 << 20),
            )
            if _logged == LOGGED_MAX:
                log.error("further tasks dropped as too large are counted, not named")
