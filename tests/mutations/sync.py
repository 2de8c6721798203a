"""Mutation rows for the weight transfer: sync groups, the learner's sender, the broadcast (see :mod:`tests.mutations`)."""

from __future__ import annotations

from tests.mutations.row import Mutation

ROWS = (
    Mutation(
        "staleness.deal_at_send reaches the coordinator",
        "the pusher never opens the window at the send",
        "asyncrl/sync/sender.py",
        "        if not error and self.deal_at_send:",
        "        if False:",
        ("tests/test_weight_sync.py",),
    ),
    Mutation(
        "the sync store listens at endpoints.host only",
        "the store's server listens on every interface (torch's own)",
        "asyncrl/sync/groups.py",
        "        fd = _listening_fd(host, port) if is_host else None",
        "        fd = None",
        ("tests/test_weight_sync.py::test_the_sync_store_listens_at_the_configured_host_only",),
    ),
    Mutation(
        "failed sync groups aborted",
        "a failed or replaced sync group is only dropped",
        "asyncrl/sync/groups.py",
        "        pg.abort()",
        "        pass",
        ("tests/test_weight_sync.py",),
    ),
    Mutation(
        "sync group members meet before the first collective",
        "a member that never joins is met only by the backend's own connect",
        "asyncrl/sync/groups.py",
        "    _wait_for_members(prefixed, generation, rank, world_size, timeout_s, abandon)",
        "    pass",
        ("tests/test_weight_sync.py",),
    ),
    Mutation(
        "a member that gives up a sync meeting ends it for all",
        "members still waiting wait out their own timeout",
        "asyncrl/sync/groups.py",
        "                if store.check([_VERDICT]) and store.get(_VERDICT).decode() != _FORMED:",
        "                if False:",
        (
            "tests/test_weight_sync.py::test_a_member_waiting_when_another_gives_up_is_told_who_never_joined",
        ),
    ),
    Mutation(
        "gloo's pairwise connect is given up at the group's timeout",
        "a member that posted its address and died holds the others past it (5x and more)",
        "asyncrl/sync/groups.py",
        """            why = f"not connected within {timeout_s:.0f}s (gloo's own wait runs longer)\"""",
        '            why = ""',
        ("tests/test_sync_waits.py::test_a_constructor_that_asks_nothing_is_given_up_on_time",),
    ),
    Mutation(
        "gloo's pairwise connect is given up when the round is",
        "a lost member holds the learner's push in gloo's connect, asking nothing",
        "asyncrl/sync/groups.py",
        "        why = stop()",
        '        why = ""',
        ("tests/test_sync_waits.py::test_a_constructor_that_asks_nothing_is_given_up_on_time",),
    ),
    Mutation(
        "a group made after its connect was given up is let go",
        "it stays, unreferenced, with its connections open",
        "asyncrl/sync/groups.py",
        "                release_group(result)",
        "                pass",
        ("tests/test_sync_waits.py::test_a_constructor_that_asks_nothing_is_given_up_on_time",),
    ),
    Mutation(
        "a push the learner's own error ends is closed",
        "the error escapes with the round left open (no later push begins)",
        "asyncrl/sync/sender.py",
        '                error, fault = f"{type(e).__name__}: {e}", e',
        "                raise",
        ("tests/test_sync_rounds.py",),
    ),
    Mutation(
        "a member lost as the learner's meeting gives up",
        "the loss begins a round nobody sends, closed in the failed round's place",
        "asyncrl/sync/sender.py",
        "            if rnd.watch.fail(str(e)) is None:  # settled: a later loss begins no round",
        "            if rnd.watch.successor is None:",
        ("tests/test_sync_leftovers.py",),
    ),
    Mutation(
        "a member lost mid-send ends the learner's broadcast",
        "the send waits for a member the coordinator lost until sync.timeout_s",
        "asyncrl/sync/sender.py",
        "                    abandon=rnd.watch.lost_in_send,",
        "                    abandon=None,",
        ("tests/test_sync_lost_mid_send.py",),
    ),
    Mutation(
        "a group given up mid-send is dropped when its broadcast has ended",
        "the push thread drops it at once and waits out the collective gloo's abort leaves running",
        "asyncrl/sync/groups.py",
        "    if busy_s > 0:",
        "    if False:",
        (
            "tests/test_sync_lost_mid_send.py::test_a_member_lost_mid_broadcast_does_not_hold_the_learner",
        ),
    ),
    Mutation(
        "the learner tells the members it gave its send up",
        "a member waits for a bucket that will not come until its own sync.timeout_s",
        "asyncrl/sync/sender.py",
        "                    give_up_send(self.store, prefix, rnd.watch.lost_in_send())",
        "                    pass",
        (
            "tests/test_sync_lost_mid_send.py::test_a_member_still_receiving_when_the_send_is_given_up_is_told_and_caught_up",
        ),
    ),
    Mutation(
        "a member's receive asks whether the send was given up",
        "the receive's waits never ask",
        "asyncrl/sync/weights.py",
        '        _wait(work, timeout_s, f"weight receive of bucket {i}", abandon, timed_waits)',
        '        _wait(work, timeout_s, f"weight receive of bucket {i}", None, timed_waits)',
        (
            "tests/test_sync_lost_mid_send.py::test_a_member_still_receiving_when_the_send_is_given_up_is_told_and_caught_up",
        ),
    ),
    Mutation(
        "a member lost as its group connects gives the group up for the learner",
        "the learner waits in gloo's connect for the dead member until sync.timeout_s",
        "asyncrl/sync/groups.py",
        "        if not why and abandon is not None and (reason := abandon()):",
        "        if False:",
        (
            "tests/test_sync_lost_members.py::test_a_member_lost_between_the_meeting_and_the_connect_does_not_hold_the_others",
        ),
    ),
    Mutation(
        "the learner tells the members it gave a connecting group up",
        "the members wait in gloo's connect for the dead member until sync.timeout_s",
        "asyncrl/sync/groups.py",
        "            _tell_given_up(prefixed, generation, why)",
        "            pass",
        (
            "tests/test_sync_lost_members.py::test_a_member_lost_between_the_meeting_and_the_connect_does_not_hold_the_others",
        ),
    ),
    Mutation(
        "a connecting member asks whether the group was given up",
        "a member never asks and waits in gloo's connect until sync.timeout_s",
        "asyncrl/sync/groups.py",
        "        why = _sent_up(prefixed)",
        '        why = ""',
        (
            "tests/test_sync_lost_members.py::test_a_member_lost_between_the_meeting_and_the_connect_does_not_hold_the_others",
        ),
    ),
    Mutation(
        "gloo's connect waits in a store that asks whether to stop",
        "gloo's constructor gets the plain store: its waits ask nothing",
        "asyncrl/sync/groups.py",
        "            lambda: _build(store, rank, world_size, backend, timeout_s), stop, timeout_s",
        "            lambda: _build(prefixed, rank, world_size, backend, timeout_s), stop, timeout_s",
        (
            "tests/test_sync_lost_members.py::test_a_member_lost_between_the_meeting_and_the_connect_does_not_hold_the_others",
        ),
    ),
    Mutation(
        "the waits that ask to give up never time a running work outside gloo",
        "every backend's waits wait in 50 ms slices (under NCCL each slice fails the collective)",
        "asyncrl/sync/weights.py",
        "    return isinstance(pg, ProcessGroupGloo)",
        "    return True",
        ("tests/test_sync_waits.py::test_waits_that_ask_to_give_up_never_time_a_running_work",),
    ),
    Mutation(
        "a wait that only looks at its work never times it",
        "the looking wait sleeps in a timed wait on the work",
        "asyncrl/sync/weights.py",
        "        time.sleep(min(pause, left))",
        "        work.wait(timedelta(seconds=left))",
        ("tests/test_sync_waits.py::test_waits_that_ask_to_give_up_never_time_a_running_work",),
    ),
    Mutation(
        "the exit lets threads out of gloo's connect first",
        "a daemon thread left in gloo's connect at exit takes the GIL back there (SIGSEGV)",
        "asyncrl/sync/asking_store.py",
        "atexit.register(_let_constructors_out)",
        "pass",
        (
            "tests/test_sync_waits.py::test_a_process_exits_cleanly_while_threads_wait_in_gloos_connect",
        ),
    ),
    Mutation(
        "the learner out of time in gloo's connect tells the members",
        "members whose connect completed wait in their receive another sync.timeout_s",
        "asyncrl/sync/groups.py",
        "            _tell_given_up(prefixed, generation, str(e))",
        "            pass",
        (
            "tests/test_sync_waits.py::test_the_learner_out_of_time_in_gloos_connect_tells_the_members",
        ),
    ),
    Mutation(
        "a sync's announcement is checked against the control bound",
        "a plan over control.max_message_mb is announced: the server's socket drops it unread",
        "asyncrl/sync/sender.py",
        "            check_sync_start(plan, self.max_message_bytes)  # a server could not read it",
        "            pass",
        (
            "tests/test_sync_start_size.py::test_the_pusher_refuses_a_plan_before_any_round_and_a_fitting_one_reaches_the_server",
        ),
    ),
    Mutation(
        "the learner builds its sync plan at start",
        "a plan the servers cannot read stops the run only at its first push",
        "learner/control_plane.py",
        "            self.pushes.pusher.plan_for(tensors)",
        "            pass",
        (
            "tests/test_sync_start_size.py::test_the_learner_stops_at_start_when_its_syncs_could_not_be_announced",
        ),
    ),
    Mutation(
        "a learner config error found in its run exits CONFIG_ERROR",
        "the launcher restarts a learner that will fail the same way",
        "learner/main.py",
        "            loop = LearnerLoop(cfg)\n        return loop.run()\n    except ConfigError as e:",
        '            loop = LearnerLoop(cfg)\n    except ConfigError as e:\n        log.error("cannot start: %s", "; ".join(e.problems))\n        return CONFIG_ERROR\n    return loop.run()\n    try:\n        pass\n    except ConfigError as e:',
        (
            "tests/test_sync_start_size.py::test_the_learner_stops_at_start_when_its_syncs_could_not_be_announced",
        ),
    ),
)
