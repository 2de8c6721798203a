"""Mutation rows for the replay buffer service (see :mod:`tests.mutations`)."""

from __future__ import annotations

from tests.mutations.row import T_RECOVERY, Mutation

ROWS = (
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
        "duplicate of a forgotten group reported (F1)",
        "the buffer drops it silently (its charge stays)",
        "buffer/assembly.py",
        '        if closed == "complete" and tid not in s.held and not traj.validation:',
        "        if False:",
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
        "rollout log write failures",
        "a failed rollout-log write ends the buffer",
        "buffer/rollout_log.py",
        "        except (OSError, pa.ArrowException) as e:",
        "        except ZeroDivisionError as e:",
        ("tests/test_rollout_log.py",),
    ),
    Mutation(
        "members of open groups get in at the incomplete bound",
        "incomplete groups at their bound stop the reading",
        "buffer/core.py",
        "        return len(self._s.held) < self.capacity",
        "        return len(self._s.held) < self.capacity and len(self._s.partial) < self.capacity",
        ("tests/test_buffer_members.py",),
    ),
    Mutation(
        "a long pause of the full buffer is warned about",
        "a buffer full for minutes says nothing",
        "buffer/service_stats.py",
        "        if self._paused_since is None or now - self._paused_since < self._pause_warn_at:",
        "        if True:",
        (
            "tests/test_buffer_stats.py::test_a_long_pause_is_warned_at_each_doubling_and_a_new_pause_starts_over",
        ),
    ),
    Mutation(
        "a stale learner's requests are refused",
        "every client under a consumer id is served",
        "buffer/consumers.py",
        "        if latest is None or incarnation == latest:\n",
        "        if True:\n",
        ("tests/test_buffer_superseded.py",),
    ),
    Mutation(
        "an audit does not call queued groups lost",
        "an audit reads paused only while the buffer is full at that instant",
        "buffer/service.py",
        "            or self.stats.paused\n"
        "            or self._backlog\n"
        "            or (resumed is not None and self._drained_at < resumed)\n",
        "",
        ("tests/test_buffer_audit.py",),
    ),
    Mutation(
        "a refused message's groups are reported dropped",
        "a refused message is counted only (its groups stay 'in buffer' until re-dealt)",
        "buffer/service.py",
        "        dropped = [t.task_id for t in named if self.buffer.reject(t.task_id, cause, t.validation)]",
        "        dropped: list[str] = []",
        ("tests/test_buffer_refusals.py",),
    ),
    Mutation(
        "an audit after the socket is drained is not paused",
        "a drain is never recorded (the audit reads paused after any pause, for good)",
        "buffer/service.py",
        "                    self._drained_at = time.monotonic()\n",
        "                    pass\n",
        ("tests/test_buffer_audit.py",),
    ),
    Mutation(
        "policy versions are bounded on the wire",
        "any uint64 version decodes (its lag crashed the buffer when a batch encoded it)",
        "asyncrl/wire/types.py",
        "Version = Annotated[int, msgspec.Meta(ge=0, le=MAX_VERSION)]",
        "Version = NonNegInt",
        ("tests/test_buffer_refusals.py",),
    ),
    Mutation(
        "the wire refuses a reward float32 cannot hold",
        "a 1e39 reward decodes (its group's advantages NaN in the learner)",
        "asyncrl/wire/codec.py",
        "    if not usable_reward(m.reward) or (",
        "    if not math.isfinite(m.reward) or (",
        ("tests/test_wire.py",),
    ),
    Mutation(
        "a request the buffer fails on is answered and counted",
        "the exception ends the buffer's thread (every group it holds lost)",
        "buffer/service.py",
        "                    self._on_request(router, envelope, msg)",
        "                    self._answers.on_request(router, envelope, msg)",
        ("tests/test_buffer_refusals.py",),
    ),
)
