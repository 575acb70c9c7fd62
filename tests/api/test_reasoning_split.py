"""ReasoningSplitter on its own: every way of cutting an answer into deltas gives the same split."""

from __future__ import annotations

import pytest

from tidal.service.reasoning import ReasoningSplitter, prompt_state, thinks_first

CASES = [
    # (parser, prompt state, answer, reasoning, content)
    ("qwen3", "none", "<think>let me see</think>The answer", "let me see", "The answer"),
    ("qwen3", "none", "\n<think>a<b</think>c</think>d", "a<b", "c</think>d"),
    ("qwen3", "none", "No thinking here", "", "No thinking here"),
    ("qwen3", "none", "<thin", "", "<thin"),
    ("qwen3", "closed", "plain", "", "plain"),
    ("qwen3", "open", "still thinking</think>done", "still thinking", "done"),
    ("qwen3", "none", "<think>cut off by max_tokens</thi", "cut off by max_tokens</thi", ""),
    ("deepseek_r1", "none", "thinking</think>answer", "thinking", "answer"),
    ("deepseek_r1", "none", "<think>thinking</think>answer", "thinking", "answer"),
    ("deepseek_r1", "none", "never closed", "never closed", ""),
    ("deepseek_r1", "closed", "answer only", "", "answer only"),
]


def split(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = [], []
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = splitter.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize("parser, prompt, answer, reasoning, content", CASES)
def test_every_cut_gives_the_same_split(parser, prompt, answer, reasoning, content):
    assert split(ReasoningSplitter(parser, prompt), [answer]) == (reasoning, content)
    assert split(ReasoningSplitter(parser, prompt), list(answer)) == (reasoning, content)  # one character each
    for i in range(len(answer) + 1):
        for j in range(i, len(answer) + 1):
            pieces = [answer[:i], answer[i:j], answer[j:]]
            assert split(ReasoningSplitter(parser, prompt), pieces) == (reasoning, content), pieces


def test_a_tag_cut_across_deltas_is_held_not_leaked():
    splitter = ReasoningSplitter("qwen3")
    assert splitter.feed("<th") == ("", "")
    assert splitter.feed("ink>abc</th") == ("abc", "")
    assert splitter.feed("ink>x") == ("", "x")


def test_the_prompt_decides_where_the_answer_starts():
    assert prompt_state("<|assistant|>\n<think>\n") == "open"
    assert prompt_state("<|assistant|>\n<think>\n\n</think>\n\n") == "closed"
    assert prompt_state("<think>a</think>old answer<|end|>\n<|assistant|>\n") == "none"
    assert thinks_first("deepseek_r1", "none") and not thinks_first("qwen3", "none")
    assert not thinks_first("deepseek_r1", "closed") and thinks_first("qwen3", "open")
