"""Hypothesis strategies for hostile request bodies: near-valid OpenAI bodies with any field
replaced by any JSON value or a value at or past a bound, arbitrary JSON, deep nesting and
raw bytes. Sensible values are kept small (max_tokens <= 4) so valid requests finish quickly.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

SERVED_MODEL = "tidal-tiny"

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from([0, -1, 1, 2**31, -(2**31) - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -0.0, ""]),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


def field(sensible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a sensible value, sometimes any JSON value."""
    return st.one_of(sensible, sensible, json_values)


text_parts = st.lists(st.fixed_dictionaries(
    {"type": field(st.sampled_from(["text", "image_url", "input_audio"]))},
    optional={"text": field(st.text(max_size=30))}), max_size=3)
messages = st.lists(st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"]))},
    optional={"content": field(st.one_of(st.text(max_size=60), text_parts, st.none())),
              "name": field(st.text(max_size=10))}), max_size=3)

COMMON = {
    "model": field(st.sampled_from([SERVED_MODEL, "gpt-4o", ""])),
    "temperature": field(st.floats(-0.5, 2.5)),
    "top_p": field(st.floats(-0.1, 1.1)),
    "top_k": field(st.integers(-3, 50)),
    "min_p": field(st.floats(-0.1, 1.1)),
    "seed": field(st.integers(-(2**64), 2**65)),
    "stop": field(st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20))),
    "stop_token_ids": field(st.lists(st.integers(-5, 40_000), max_size=20)),
    "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)),
    "repetition_penalty": field(st.floats(-1, 11)),
    "ignore_eos": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
    "stream_interval": field(st.integers(-1, 3)),
    "priority": field(st.integers(-(2**32), 2**32)),
    "n": field(st.integers(0, 2)),
    "logprobs": field(st.one_of(st.booleans(), st.integers(0, 2))),
    "user": field(st.text(max_size=10)),
    "unknown_field": json_values,
}

# max_tokens is always there (mostly 1-4) so that valid requests finish in a few steps
chat_bodies = st.fixed_dictionaries({"messages": field(messages), "max_tokens": field(st.integers(-1, 4))},
                                    optional={**COMMON, "max_completion_tokens": field(st.integers(-1, 4)),
                                              "top_logprobs": field(st.integers(-1, 3))})
completion_bodies = st.fixed_dictionaries(
    {"prompt": field(st.one_of(st.text(max_size=60), st.lists(st.integers(-2, 40_000), max_size=10),
                               st.lists(st.text(max_size=10), max_size=2),
                               st.lists(st.lists(st.integers(0, 100), max_size=4), max_size=2))),
     "max_tokens": field(st.integers(-1, 4))},
    optional={**COMMON, "echo": field(st.booleans()), "suffix": field(st.none())})


@st.composite
def deep(draw) -> bytes:
    depth = draw(st.integers(1, 3000))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    closed = draw(st.booleans())
    return b'{"prompt":"x","deep":' + opener * depth + b"1" + (closer * depth + b"}" if closed else b"")


def encoded(bodies: st.SearchStrategy) -> st.SearchStrategy:
    return bodies.map(lambda body: json.dumps(body).encode())


def raw_bodies(bodies: st.SearchStrategy) -> st.SearchStrategy:
    """Bytes to send as a request body: mostly JSON objects, then anything at all."""
    return st.one_of(
        encoded(bodies), encoded(bodies), encoded(bodies),
        encoded(json_values), deep(), st.binary(max_size=64),
        encoded(bodies).map(lambda b: b[:-1]),  # truncated
        st.text(max_size=64).map(str.encode),
    )
