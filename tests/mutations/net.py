"""Mutation rows for the transport: sockets, serving, taken requests (see :mod:`tests.mutations`)."""

from __future__ import annotations

from tests.mutations.row import Mutation

ROWS = (
    Mutation(
        "per-role authority (S1)",
        "every role may send every request",
        "asyncrl/net/serving.py",
        "            if self.policy is not None and not self.policy.permits(role, msg.kind):",
        "            if False:",
        ("tests/test_authority.py",),
    ),
    Mutation(
        "a pusher's close names the messages it drops",
        "the close warning names no task id",
        "asyncrl/net/transport.py",
        "                self._recent.append(label)\n",
        "                pass\n",
        ("tests/test_transport.py",),
    ),
    Mutation(
        "a role whose port is taken exits 2 in one line",
        "a taken port is not checked before the role starts",
        "asyncrl/net/taken.py",
        "    taken = {k: v for k, v in listens.items() if not bindable(*v)}\n",
        "    taken: dict = {}\n",
        ("tests/test_launch_taken.py",),
    ),
    Mutation(
        "a served socket whose bind fails is closed",
        "the socket stays open behind the error",
        "asyncrl/net/serving.py",
        "            self.sock.close(linger=0)\n",
        "",
        ("tests/test_transport.py",),
    ),
    Mutation(
        "a late reply does not lift the next request's timeout",
        "the receive after the poll blocks, for good where the server restarted",
        "asyncrl/net/transport.py",
        "                return self._sock.recv_multipart(zmq.DONTWAIT, copy=False)",
        "                return self._sock.recv_multipart(copy=False)",
        (
            "tests/test_transport.py::"
            "test_a_late_reply_to_a_timed_out_request_does_not_lift_the_next_ones_timeout",
        ),
    ),
    Mutation(
        "a closed CURVE socket's handshake watcher ends",
        "the watcher waits for a stop event its monitor never gets, as long as the context",
        "asyncrl/net/handshakes.py",
        "    events = HANDSHAKE_FAILURES | zmq.EVENT_MONITOR_STOPPED",
        "    events = HANDSHAKE_FAILURES",
        ("tests/test_security.py::test_closed_curve_sockets_end_their_handshake_watchers",),
    ),
    Mutation(
        "a batch slower to arrive than the wait is waited for longer",
        "a batch that takes longer than the wait to arrive comes late every time",
        "asyncrl/net/buffer_client.py",
        "            self.batch_timeout_s = longer",
        "            longer = self.batch_timeout_s",
        (
            "tests/test_buffer_replies.py::"
            "test_a_batch_slower_to_arrive_than_the_wait_is_waited_for_longer",
        ),
    ),
    Mutation(
        "a CURVE node dialling a plain server is told auth may differ",
        "the client's line names only its keys",
        "asyncrl/net/handshakes.py",
        '                "(endpoints.auth must be the same on every node), or it went away "',
        '                "or it went away "',
        (
            "tests/test_security.py::"
            "test_a_curve_node_dialling_a_plain_server_is_told_auth_may_differ",
        ),
    ),
    Mutation(
        "a grown batch wait comes back while replies are fast",
        "a wait grown once stays, delaying every request a buffer restart loses",
        "asyncrl/net/buffer_client.py",
        "                self.batch_timeout_s = max(self.timeout_s, self.batch_timeout_s / 2)",
        "                pass",
        (
            "tests/test_buffer_replies.py::"
            "test_a_batch_slower_to_arrive_than_the_wait_is_waited_for_longer",
        ),
    ),
    Mutation(
        "only a batch request given up grows the batch wait",
        "a late answer to a validation poll doubles every batch's wait",
        "asyncrl/net/buffer_client.py",
        "        if not self._batch_given_up:  # a late reply to another request (a validation poll)",
        "        if False:",
        (
            "tests/test_buffer_replies.py::"
            "test_a_late_answer_to_another_request_does_not_grow_the_batch_wait",
        ),
    ),
)
