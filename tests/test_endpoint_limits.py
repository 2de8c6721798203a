"""The OpenAI endpoint's sessions at the prompt limit: the real endpoint served over HTTP on
127.0.0.1 (a character tokenizer and a stand-in engine, no vLLM).

A session's new sample (a rewritten conversation, a raw completion) was refused past
``data.max_prompt_length`` though the engine's context (the prompt and response limits
together) could take it, where the server's own agent episodes split past it: an agent
that rewrites its history (a trimmed or summarised past) ended as soon as that history
outgrew the prompt limit. It now follows the agents' rule: the prompt and the response
budget the session has left fit the engine's context, the prompt's tokens past the limit
leading the sample's response on the wire, masked, so the buffer's limits still hold.
"""

from __future__ import annotations

import asyncio

from asyncrl import wire
from rollout_servers.sessions import Session
from tests.standins.chat import EOT, REPLY
from tests.test_endpoint_clients import _post
from tests.test_endpoint_faults import USER, Rig, _serve, _state
from tests.test_endpoint_mends import AckingClient, _chat, _reward
from tests.test_endpoint_slots import RecordingPusher

PROMPT_LIMIT, RESPONSE_LIMIT = 64, 512


def _rendered(*messages: tuple[str, str]) -> int:
    """Tokens of a conversation as the character template renders it (no tools), with the
    generation prompt."""
    return len("[]" + "".join(f"<{r}>{c}{EOT}" for r, c in messages) + "<assistant>")


def test_a_rewritten_history_may_pass_the_prompt_limit_within_the_engines_context(monkeypatch):
    async def scenario(rig: Rig) -> None:
        groups = rig.endpoint.groups
        groups.client, groups.pusher = AckingClient(), RecordingPusher()  # type: ignore[assignment]
        status, body = await rig.chat([USER])
        assert status == 200, body
        # Rewritten (the first message changed), with the model's turn and a long tool
        # answer after it: the answer is the session's response, as the agent's split's is.
        said = body["choices"][0]["message"]
        answer = "y" * 60
        history = [{"role": "user", "content": "hi!"}, said, {"role": "tool", "content": answer}]
        status, body = await rig.chat(history)
        assert status == 200, body
        session: Session = rig.session()
        piece = session.episode.pieces[-1]
        long = _rendered(("user", "hi!"), ("assistant", "ok"), ("tool", answer))
        assert len(piece.prompt_ids) == long > PROMPT_LIMIT
        assert piece.overflow == long - PROMPT_LIMIT and piece.lead == len(
            f"<tool>{answer}{EOT}<assistant>"
        )
        # A raw completion of the session, too: a new sample past the limit.
        raw = {"model": "m", "prompt": "z" * 80, "max_tokens": 8}
        status, body = await _post(rig, raw, path="/v1/completions")
        assert status == 200 and session.episode.pieces[-1].overflow == 80 - PROMPT_LIMIT, body
        # Past the engine's context: refused as the end of the context window, the session
        # as it was.
        before = _state(session)
        status, body = await rig.chat([{"role": "user", "content": "z" * 600}])
        error = body["error"]
        assert status == 400 and error["code"] == "context_length_exceeded", body
        assert "no longer fit the engine's context" in error["message"]
        assert _state(session) == before
        assert (await rig.reward({"reward": 1.0}))[0] == 200
        assert (await _chat(rig, "g/1"))[0] == 200  # the group's other member
        assert (await _reward(rig, "g/1", 0.0))[0] == 200
        await asyncio.gather(*groups._pushes)
        (pushed,) = groups.pusher.groups  # type: ignore[attr-defined]
        limits = wire.Limits(max_prompt_len=PROMPT_LIMIT, max_response_len=RESPONSE_LIMIT)
        taken = wire.decode_trajectories(wire.encode_trajectories(list(pushed)), limits)
        assert len(taken) == 4  # the buffer takes every sample
        taken = [t for t in taken if t.meta.episode_index == 0]
        pieces = session.episode.pieces
        assert len(taken) == len(pieces) == 3
        for t, p in zip(taken, pieces, strict=True):
            assert list(t.prompt_ids) + list(t.response_ids) == p.prompt_ids + p.token_ids
            if p.overflow:  # the prompt's tokens past the limit lead the response, masked
                assert t.meta.prompt_len == PROMPT_LIMIT
                assert t.meta.masked_spans[0] == (0, p.overflow)
                assert list(t.response_ids[p.overflow :]) == [ord(c) for c in REPLY]

    limits = (
        f"data.max_prompt_length={PROMPT_LIMIT}",
        f"data.max_response_length={RESPONSE_LIMIT}",
    )
    _serve(monkeypatch, scenario, limits)
