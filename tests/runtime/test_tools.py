"""Tool calling's parts: definitions and tool_choice, the hermes parser (streamed in any
pieces = parsed whole), the prompt for templates with and without tool support, and the
grammars each tool_choice makes."""

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from qserve.runtime.loaded_model import load
from qserve.runtime.structured.compiler import GrammarCompiler
from qserve.runtime.structured.grammar_state import GrammarState
from qserve.runtime.tools import (FORMATS, ToolError, parse_tool_choice, parse_tools,
                                  pick_format)
from qserve.runtime.tools.prompt import render_tool_messages

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

TOOLS = parse_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}}])
HERMES = FORMATS.get("hermes")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}"}}\n</tool_call>'


def _stream(text, pieces):
    parser = HERMES.parser(TOOLS)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events, parser.result()


def _split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("text, content, calls", [
    (CALL, None, [("get_weather", {"city": 'Pa"ris {x}'})]),
    ("Let me check.\n" + CALL + "\n" + CALL.replace("get_weather", "add").replace(
        '{"city": "Pa\\"ris {x}"}', '{"a": 1, "b": 2}'), "Let me check.",
     [("get_weather", {"city": 'Pa"ris {x}'}), ("add", {"a": 1, "b": 2})]),
    ('<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call>', None,
     [("add", {"a": 1, "b": 2})]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>', None,
     [("add", {"a": 1, "b": 2})]),
    ("No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
    # not calls: an unknown function, broken JSON, a block the output never closed
    ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),
    ('x <tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
     'x <tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', []),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1', '<tool_call>\n{"name": "add", '
     '"arguments": {"a": 1', []),
    # a reply that is only a call's JSON, bare or fenced, is that call
    ('```json\n{\n  "name": "add",\n  "arguments": {"a": 1, "b": 2}\n}\n```', None,
     [("add", {"a": 1, "b": 2})]),
    ('{"name": "get_weather", "arguments": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})]),
    ('```json\n{"name": "sub", "arguments": {}}\n```', '```json\n{"name": "sub", '
     '"arguments": {}}\n```', []),
    ('```python\nprint(1)\n```', '```python\nprint(1)\n```', []),
    ('{"a": 1} and more', '{"a": 1} and more', []),
    # max_tokens cut a second call: the whole first one is the answer
    (CALL + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1', None,
     [("get_weather", {"city": 'Pa"ris {x}'})]),
])
def test_hermes_parser_streamed_in_any_pieces_equals_parsed_whole(text, content, calls):
    _, whole = _stream(text, [text])
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    rng = random.Random(0)
    for _ in range(30):
        events, parsed = _stream(text, _split(text, rng))
        assert parsed.content == whole.content
        assert [(c.name, c.arguments) for c in parsed.calls] == [
            (c.name, c.arguments) for c in whole.calls]
        if calls and parsed.calls:  # the streamed deltas add up to the calls (a call cut
            #                         by max_tokens may have begun streaming: not counted)
            names = [e.text for e in events if e.kind == "call"][:len(parsed.calls)]
            args = {}
            for e in events:
                if e.kind == "arguments":
                    args[e.index] = args.get(e.index, "") + e.text
            assert names == [c.name for c in parsed.calls]
            assert [args[i] for i in range(len(names))] == [c.arguments for c in parsed.calls]
            assert "".join(e.text for e in events if e.kind == "content") == (content or "")


def test_a_call_streams_its_name_before_its_arguments_end():
    parser = HERMES.parser(TOOLS)
    events = parser.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert [(e.kind, e.text) for e in events] == [("call", "add"), ("arguments", '{"a": 1')]
    assert events[0].call_id.startswith("call_")


@pytest.mark.parametrize("tools, param", [
    ("x", "tools"),
    ([{"type": "function", "function": {"name": "a"}}] * 2, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "a", "description": 3}}],
     "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "a", "strict": "yes"}}],
     "tools[0].function.strict"),
])
def test_bad_tools_name_the_field(tools, param):
    with pytest.raises(ToolError) as e:
        parse_tools(tools)
    assert e.value.param == param


def test_tool_choice():
    assert parse_tool_choice(None, TOOLS).mode == "auto"
    assert parse_tool_choice(None, ()).mode == "none"
    named = parse_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS)
    assert [t.name for t in named.offered(TOOLS)] == ["add"]
    assert parse_tool_choice("none", TOOLS).offered(TOOLS) == ()
    with pytest.raises(ToolError, match="not among the tools"):
        parse_tool_choice({"type": "function", "function": {"name": "sub"}}, TOOLS)
    with pytest.raises(ToolError, match="must be"):
        parse_tool_choice("sometimes", TOOLS)


def test_format_is_picked_from_the_template():
    assert pick_format("{{ '<tool_call>' }}").name == "hermes"
    assert pick_format(None).name == "hermes"  # the generic prompt writes hermes calls
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        pick_format(None, "nope")


HISTORY = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Weather in Paris and 1 + 2?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"id": "c2", "name": "add", "arguments": '{"a": 1, "b": 2}'}]},
           {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
           {"role": "tool", "tool_call_id": "c2", "content": "3"}]


def test_templates_with_tool_support_get_tools_and_argument_objects():
    msgs, tools = render_tool_messages(HISTORY, TOOLS, HERMES, "{% if tools %}...{% endif %}")
    assert [t["function"]["name"] for t in tools] == ["get_weather", "add"]
    assert msgs[2]["tool_calls"][1]["function"]["arguments"] == {"a": 1, "b": 2}
    assert msgs[3] == HISTORY[3]


def test_templates_without_tool_support_get_the_format_as_text():
    msgs, tools = render_tool_messages(HISTORY, TOOLS, HERMES, "{{ messages }}")
    assert tools is None
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "add"' in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": HERMES.history_call(
        "get_weather", {"city": "Paris"}) + "\n" + HERMES.history_call("add", {"a": 1, "b": 2})}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>\n"
                                                  "<tool_response>\n3\n</tool_response>"}
    assert len(msgs) == 4


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    torch.set_num_threads(1)
    lm = load(str(write_tiny_llama(tmp_path_factory.mktemp("tools") / "tiny")), torch.float32)
    return GrammarCompiler(lm.tokenizer, 300)


def _accepts(compiler, spec, text):
    state = GrammarState(compiler.compile(spec))
    return all(state.accept(t) for t in compiler.tokenizer.encode(text, add_special_tokens=False))


def test_grammars_per_tool_choice(compiler):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    bad_args = '<tool_call>\n{"name": "add", "arguments": {"a": "x"'
    unknown = '<tool_call>\n{"name": "sub'
    auto = HERMES.grammar(TOOLS, parse_tool_choice("auto", TOOLS), True)
    required = HERMES.grammar(TOOLS, parse_tool_choice("required", TOOLS), True)
    named = HERMES.grammar(TOOLS, parse_tool_choice(
        {"type": "function", "function": {"name": "get_weather"}}, TOOLS), False)
    assert _accepts(compiler, auto, "Sure, " + call)
    assert _accepts(compiler, auto, "No call at all.")
    assert not _accepts(compiler, auto, "Sure, " + bad_args)  # a begun call is held to it
    assert not _accepts(compiler, auto, unknown)
    assert _accepts(compiler, required, call + "\n" + call)
    assert not _accepts(compiler, required, "Sure")  # required: calls only
    assert not _accepts(compiler, named, call)  # named: that function only
    assert _accepts(compiler, named, call.replace('"add", "arguments": {"a": 1, "b": 2}',
                                                  '"get_weather", "arguments": {"city": "x"}'))
    assert HERMES.grammar(TOOLS, parse_tool_choice("none", TOOLS), True) is None
