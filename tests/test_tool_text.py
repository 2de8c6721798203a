"""What travels as text between a model and its tools: hermes tool-call blocks parsed out of
a model's reply (every call, and each malformed block named in order), and a long tool
response cut at the side the config says. Pure functions, no worker process."""

from __future__ import annotations

from asyncrl.tools import ToolCall, parse_tool_calls, truncate_response


def call_block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_hermes_one_and_several_calls() -> None:
    text = "Let me add.\n" + call_block('{"name": "add", "arguments": {"a": 1, "b": "2"}}')
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me add.\n"
    assert parsed.calls == [ToolCall("add", {"a": 1, "b": "2"})]
    assert parsed.errors == []
    several = (
        call_block('{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}')
        + "\n"
        + call_block('{"name": "mul", "arguments": {"a": 3, "b": 4}}')
        + call_block('{"name": "now"}')
    )
    parsed = parse_tool_calls(several)
    assert parsed.content == ""
    assert parsed.calls == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("mul", {"a": 3, "b": 4}),
        ToolCall("now", {}),
    ]
    no_call = parse_tool_calls("The answer is 7.")
    assert (no_call.content, no_call.calls, no_call.errors) == ("The answer is 7.", [], [])


def test_hermes_malformed_blocks_are_reported_in_order() -> None:
    text = "".join(
        [
            call_block('{"name": "add", "arguments": {"a": 1}'),  # unbalanced
            call_block('{"arguments": {"a": 1}}'),
            call_block('{"name": "add", "arguments": [1, 2]}'),
            call_block('{"name": "add", "arguments": "{not json"}'),
            call_block('["add"]'),
            call_block('{"name": "ok", "arguments": {}}'),
            "<tool_call>\n{'name': 'cut off",
        ]
    )
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("ok", {})]
    assert len(parsed.errors) == 6
    expected = [
        "tool call 1: not valid JSON",
        "tool call 2: missing 'name'",
        "tool call 3: 'arguments' must be a JSON object, got list",
        "tool call 4: 'arguments' is a string but not valid JSON",
        "tool call 5: expected a JSON object",
        "tool call 7: <tool_call> without </tool_call>",
    ]
    for error, start in zip(parsed.errors, expected, strict=True):
        assert error.startswith(start), error


def test_truncate_response_each_side() -> None:
    text = "abcdefghij"
    assert truncate_response(text, 10, "left") == text
    assert truncate_response(text, 4, "left") == "abcd...(truncated)"
    assert truncate_response(text, 4, "right") == "(truncated)...ghij"
    assert truncate_response(text, 4, "middle") == "ab...(truncated)...ij"
    assert truncate_response(text, 1, "middle") == "...(truncated)..."


def test_tool_call_blocks_are_found_in_one_pass_as_the_lazy_match_found_them():
    """Found by a review: the blocks were found with a lazy regular expression, which
    scans to the end of the text from every open tag never closed: 44k characters of
    repeated open tags took 2.2 s (88k, 6.7 s) on the server's event loop. The one-pass
    scan finds the same blocks."""
    import random
    import re
    import time

    from asyncrl.tools.hermes import CLOSE_TAG, OPEN_TAG, blocks

    lazy = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)
    rng = random.Random(0)
    pieces = [OPEN_TAG, CLOSE_TAG, "x", '{"name": "a"}', " ", "<tool", "call>"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        want = [(m.start(), m.end(), m.group(1)) for m in lazy.finditer(text)]
        assert list(blocks(text)) == want, text
    start = time.monotonic()
    parsed = parse_tool_calls(OPEN_TAG * 20_000)  # 220k characters: about a minute lazily
    assert time.monotonic() - start < 5.0 and not parsed.calls and len(parsed.errors) == 1
