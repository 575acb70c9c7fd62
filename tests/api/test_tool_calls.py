"""Tool-call formats (tidal.service.tool_calls): parsing each model family's output, whole and streamed,
the schemas forced calls are generated under, and tools reaching the chat template."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from tidal.gpu.model import tiny_model
from tidal.service.tool_calls import ToolCallStream, parse_forced, parse_model_output, required_schema

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}}}


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "", [("get_weather", {"city": "A"}), ("get_time", {})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "utc"}}; '
                    '{"name": "get_weather", "parameters": {"city": "B"}}', "",
     [("get_time", {"tz": "utc"}), ("get_weather", {"city": "B"})]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]', "",
     [("get_weather", {"city": "Rome"})]),
    ("hermes", "No tools needed.", "No tools needed.", []),
    ("llama3_json", "Plain words {not json}", "Plain words {not json}", []),
])
def test_parse_model_output(parser, text, content, calls):
    got_content, got_calls = parse_model_output(parser, text)
    assert got_content == content and _calls(got_calls) == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Sure! <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
    ("mistral", 'Sure! [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("llama3_json", '  {"name": "get_weather", "parameters": {"city": "Paris"}}'),
])
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_text_releases_content_and_holds_calls(parser, text, step):
    """Split at every position: content streams as it comes, the marker is never shown."""
    stream = ToolCallStream(parser=parser)
    content = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step))
    tail, calls = stream.finish()
    assert (content + tail).strip() == ("Sure!" if parser != "llama3_json" else "")
    assert _calls(calls) == [("get_weather", {"city": "Paris"})]


def test_streamed_plain_text_is_all_content():
    for parser in ("hermes", "mistral", "llama3_json"):
        stream = ToolCallStream(parser=parser)
        text = "Just <tool an answer [TOOL"
        out = "".join(stream.feed(ch) for ch in text)
        tail, calls = stream.finish()
        assert out + tail == text and calls == []


def test_a_call_cut_short_is_returned_as_text():
    stream = ToolCallStream(parser="hermes")
    assert stream.feed('Hi <tool_call>{"name": "get_wea') == "Hi "
    assert stream.finish() == ('<tool_call>{"name": "get_wea', [])


def test_forced_calls():
    assert _calls(parse_forced('{"city":"Paris"}', "get_weather")) == [("get_weather", {"city": "Paris"})]
    assert _calls(parse_forced('[{"name":"get_time","arguments":{"tz":"cet"}}]', None)) == [("get_time", {"tz": "cet"})]
    schema = required_schema([WEATHER, TIME], parallel=False)
    jsonschema.validate([{"name": "get_time", "arguments": {"tz": "utc"}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # one call only without parallel_tool_calls
        jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, schema)
    with pytest.raises(jsonschema.ValidationError):  # the arguments follow the named tool's parameters
        jsonschema.validate([{"name": "get_weather", "arguments": {"tz": "utc"}}], schema)


def test_tools_reach_the_chat_template(tmp_path):
    """The template sees ``tools`` as transformers passes them (here it prints their names)."""
    from tidal.tokenizer import PromptTokenizer

    model = tmp_path / "m"
    shutil.copytree(tiny_model.asset_dir(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                               "{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = PromptTokenizer(str(model), 1)
    tools = [{"type": "function", "function": WEATHER}]
    ids = tokenizer._encode_chat([{"role": "user", "content": "hi"}], tools)
    assert tokenizer.tokenizer.decode(ids).startswith("TOOLS:get_weather;user:hi")
