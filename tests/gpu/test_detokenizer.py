"""IncrementalDetokenizer: streamed text equals the full decode, and stop strings cut it right."""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import tidal
from tidal.gpu.detokenizer import IncrementalDetokenizer

TIDAL_TINY_TOKENIZER = Path(tidal.__file__).parent / "assets" / "tidal-tiny" / "tokenizer.json"

REPLACEMENT = "\ufffd"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>"]
CORPUS = [
    "Hello world, this is a test of the tidal tokenizer.",
    "héllo 世界 🎉 naïve café, señor. Grüße!",
    "\n\nUser: hi there\n\nAssistant: hello, how can I help?",
    "The quick brown fox jumps over the lazy dog 1234567890.",
    "日本語のテキストと한국어 텍스트 Ελληνικά кириллица 😀👍🏽",
]


def gpt2_byte_chars() -> dict[int, str]:
    """The byte -> character map of GPT-2 style byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + shift)
            shift += 1
    return chars


def train_byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return tokenizer


TOKENIZER = train_byte_level_bpe()
VOCAB_SIZE = TOKENIZER.get_vocab_size()
BYTE_IDS = {b: TOKENIZER.token_to_id(c) for b, c in gpt2_byte_chars().items()}
# bytes that start or continue multi-byte characters, plus ASCII and never-valid bytes
AWKWARD_BYTE_IDS = [BYTE_IDS[b] for b in (0x41, 0x80, 0x96, 0x9F, 0xB8, 0xBF, 0xC3, 0xE0, 0xE4, 0xF0, 0xFF)]
SPECIAL_IDS = [TOKENIZER.token_to_id(t) for t in SPECIAL_TOKENS]

token_ids = st.one_of(
    st.integers(0, VOCAB_SIZE - 1), st.sampled_from(AWKWARD_BYTE_IDS), st.sampled_from(SPECIAL_IDS))
texts = st.text(
    st.one_of(
        st.sampled_from(list("ab \n:Uéç世界🎉😀ü")),
        st.characters(codec="utf-8", exclude_characters=REPLACEMENT),
    ),
    max_size=40,
)


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.append(i) for i in ids]


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False).ids


# ------------------------------------------------------------------ decoding


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(token_ids, max_size=6), output=st.lists(token_ids, max_size=60), skip=st.booleans())
def test_pieces_concatenate_to_the_full_decode(prompt, output, skip):
    detokenizer = IncrementalDetokenizer(TOKENIZER, prompt, (), skip)
    pieces = stream(detokenizer, output)
    assert "".join(pieces) + detokenizer.flush() == TOKENIZER.decode(output, skip_special_tokens=skip)
    assert detokenizer.stop_string is None


@settings(max_examples=200, deadline=None)
@given(prompt=texts, text=texts)
def test_encoded_text_streams_back_without_replacement_characters(prompt, text):
    detokenizer = IncrementalDetokenizer(TOKENIZER, encode(prompt), (), True)
    pieces = stream(detokenizer, encode(text))
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert "".join(pieces) + detokenizer.flush() == text


def test_multibyte_characters_are_released_whole():
    text = "héllo 世界 🎉"
    ids = encode(text)
    assert len(ids) > len(text.split())  # some characters really are split across tokens
    detokenizer = IncrementalDetokenizer(TOKENIZER, encode("Say: "), (), True)
    pieces = stream(detokenizer, ids)
    assert "".join(pieces) == text
    assert "" in pieces  # a token ending mid-character released nothing
    assert not any(REPLACEMENT in piece for piece in pieces)


def test_a_truncated_character_comes_out_as_a_replacement_on_flush():
    detokenizer = IncrementalDetokenizer(TOKENIZER, [], (), True)
    assert "".join(stream(detokenizer, encode("ok "))) == "ok "
    assert stream(detokenizer, [BYTE_IDS[0xE4], BYTE_IDS[0xB8]]) == ["", ""]
    assert detokenizer.flush() == REPLACEMENT


def test_prompt_ending_mid_character_does_not_swallow_output_bytes():
    world = "世".encode()
    prompt = [*encode("x"), BYTE_IDS[world[0]]]
    output = [BYTE_IDS[world[1]], BYTE_IDS[world[2]], *encode("y")]
    detokenizer = IncrementalDetokenizer(TOKENIZER, prompt, (), True)
    assert "".join(stream(detokenizer, output)) + detokenizer.flush() == TOKENIZER.decode(output)


def test_special_tokens_follow_skip_special_tokens():
    output = [*encode("a"), SPECIAL_IDS[0], *encode("b")]
    for skip, expected in ((True, "ab"), (False, "a<|endoftext|>b")):
        detokenizer = IncrementalDetokenizer(TOKENIZER, [], (), skip)
        assert "".join(stream(detokenizer, output)) + detokenizer.flush() == expected


def test_long_run_of_stray_bytes_is_linear():
    output = [BYTE_IDS[0x80], BYTE_IDS[0xE4]] * 2500
    start = time.perf_counter()
    detokenizer = IncrementalDetokenizer(TOKENIZER, [], (), True)
    text = "".join(stream(detokenizer, output)) + detokenizer.flush()
    elapsed = time.perf_counter() - start
    assert text == TOKENIZER.decode(output)
    # re-decoding the whole run every step takes ~10 s here; the bounded window ~0.02 s
    assert elapsed < 3.0


def test_first_output_token_keeps_its_leading_space_with_sentencepiece_style_decoding():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()  # drops the space the text starts with
    tokenizer.train_from_iterator(
        ["Hello world and hello there world"] * 10, trainers.BpeTrainer(vocab_size=60, show_progress=False))
    ids = tokenizer.encode("Hello world and hello").ids
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:1], (), True)
    text = "".join(stream(detokenizer, ids[1:])) + detokenizer.flush()
    # the completion continues the prompt: prompt text + completion text == full text
    assert tokenizer.decode(ids[:1]) + text == "Hello world and hello"


# ------------------------------------------------------------------ stop strings


def expected_stop(output: list[int], stops: list[str]) -> tuple[int, int, set[str]] | None:
    """Reference: (step, cut, stop strings found at the cut) for the first step whose
    decoded text contains a stop string, or None."""
    for step in range(len(output)):
        text = TOKENIZER.decode(output[: step + 1])
        found = {s: text.find(s) for s in stops if s in text}
        if found:
            cut = min(found.values())
            return step, cut, {s for s, at in found.items() if at == cut}
    return None


@st.composite
def output_with_stops(draw):
    text = draw(texts.filter(bool))
    output = encode(text)
    if draw(st.booleans()):  # stray tokens too
        output += draw(st.lists(token_ids, max_size=10))
    decoded = TOKENIZER.decode(output)
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()) and decoded:
            start = draw(st.integers(0, len(decoded) - 1))
            end = draw(st.integers(start + 1, min(len(decoded), start + 8)))
            stops.append(decoded[start:end])
        else:
            stops.append(draw(st.text(st.sampled_from(list("ab \n:Ué世🎉")), min_size=1, max_size=4)))
    # a stop string ending in U+FFFD is ambiguous while a character is still incomplete
    stops = [s for s in stops if not s.endswith(REPLACEMENT)]
    return output, stops


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=output_with_stops(), prompt=texts)
def test_stop_strings_cut_at_the_earliest_match_in_the_step_that_completes_it(case, prompt):
    output, stops = case
    detokenizer = IncrementalDetokenizer(TOKENIZER, encode(prompt), tuple(stops), True)
    pieces = []
    for step, token_id in enumerate(output):
        pieces.append(detokenizer.append(token_id))
        if detokenizer.stop_string is not None:
            break
    expected = expected_stop(output, stops)
    for piece in pieces:
        assert not any(stop in piece for stop in stops)
    if expected is None:
        assert detokenizer.stop_string is None
        assert "".join(pieces) + detokenizer.flush() == TOKENIZER.decode(output)
    else:
        stop_step, cut, stops_at_cut = expected
        assert step == stop_step
        assert detokenizer.stop_string in stops_at_cut
        assert "".join(pieces) == TOKENIZER.decode(output[: stop_step + 1])[:cut]
        assert detokenizer.flush() == ""


def test_possible_start_of_a_stop_string_is_held_back():
    detokenizer = IncrementalDetokenizer(TOKENIZER, [], ("\n\nUser:",), True)
    released = "".join(stream(detokenizer, encode("Sure.\n\n")))
    assert released == "Sure."
    assert detokenizer.stop_string is None
    # not a stop after all: the held text comes out with what follows
    assert "".join(stream(detokenizer, encode("Next"))) == "\n\nNext"


def test_stop_string_spanning_tokens_ends_the_request_at_its_last_token():
    output = encode("Sure.\n\nUser: more")
    detokenizer = IncrementalDetokenizer(TOKENIZER, [], ("\n\nUser:",), True)
    released = ""
    for step, token_id in enumerate(output):
        released += detokenizer.append(token_id)
        if detokenizer.stop_string is not None:
            break
    assert detokenizer.stop_string == "\n\nUser:"
    assert released == "Sure."
    assert TOKENIZER.decode(output[: step + 1]).endswith("User:")
    assert not TOKENIZER.decode(output[:step]).endswith("User:")


def test_token_holding_the_end_of_a_stop_string_and_more_is_cut():
    output = encode("Hello there")
    assert TOKENIZER.decode(output[-1:]) == " there"
    # the stop starts in the previous token and ends inside the last one, which continues
    detokenizer = IncrementalDetokenizer(TOKENIZER, [], ("o th",), True)
    assert stream(detokenizer, output) == ["Hell", ""]
    assert detokenizer.stop_string == "o th"


def test_earliest_stop_string_wins():
    detokenizer = IncrementalDetokenizer(TOKENIZER, [], ("world", "lo w"), True)
    assert "".join(stream(detokenizer, encode("Hello world"))) == "Hel"
    assert detokenizer.stop_string == "lo w"


def test_stop_strings_ignore_the_prompt():
    detokenizer = IncrementalDetokenizer(TOKENIZER, encode("User: hi\n\n"), ("\n\nUser:",), True)
    assert "".join(stream(detokenizer, encode("User: yes"))) == "User: yes"
    assert detokenizer.stop_string is None


def test_flush_returns_held_back_text():
    detokenizer = IncrementalDetokenizer(TOKENIZER, [], ("\n\nUser:",), True)
    assert "".join(stream(detokenizer, encode("Done\n\nUs"))) == "Done"
    assert detokenizer.flush() == "\n\nUs"


def test_tidal_tiny_tokenizer_streams_text_back():  # the tokenizer is committed (tidal/assets): never skipped
    tokenizer = Tokenizer.from_file(str(TIDAL_TINY_TOKENIZER))
    text = "héllo 世界 🎉\n\nUser: ok"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer, [], ("User",), True)
    pieces = stream(detokenizer, ids)
    assert detokenizer.stop_string == "User"
    assert "".join(pieces) == tokenizer.decode(ids).split("User")[0]
