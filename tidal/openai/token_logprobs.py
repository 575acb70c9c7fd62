"""Logprobs from the engine's compact arrays into OpenAI's two JSON shapes.

Chat (``logprobs: true``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Completions (legacy ``logprobs: N``): ``{"tokens", "token_logprobs", "top_logprobs": [dict],
"text_offset"}``. A token's string is its own decoded text; its ``bytes`` are the exact bytes
it stands for (a byte-level BPE token may hold part of a UTF-8 character, shown as U+FFFD in
the string). ``return_tokens_as_token_ids`` (vLLM) writes tokens as ``"token_id:N"`` instead.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tidal.wire import Logprobs


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted (byte-level BPE vocabularies use it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenTexts:
    """Token id -> (string, bytes), cached (a vocabulary has a bounded number of entries)."""

    def __init__(self, fast_tokenizer: Any):
        self._tok = fast_tokenizer  # a `tokenizers.Tokenizer`
        self._byte_level = _is_byte_level(fast_tokenizer)
        self._bytes_of_char = _byte_level_decoder() if self._byte_level else {}
        self.text = lru_cache(maxsize=1 << 16)(self._text)

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        string = self._tok.decode([token_id], skip_special_tokens=False)
        piece = self._tok.id_to_token(token_id)
        if self._byte_level and piece is not None and all(c in self._bytes_of_char for c in piece):
            return string, [self._bytes_of_char[c] for c in piece]
        return string, list(string.encode())


def _is_byte_level(fast_tokenizer: Any) -> bool:
    import json

    decoder = json.loads(fast_tokenizer.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) or []]
    return "ByteLevel" in kinds


class LogprobsFormatter:
    """One request's logprobs, chunk by chunk (keeps the text offset of legacy completions)."""

    def __init__(self, kind: str, texts: TokenTexts, as_token_ids: bool):
        self.kind = kind
        self.texts = texts
        self.as_token_ids = as_token_ids
        self.text_offset = 0

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        string, raw = self.texts.text(token_id)
        return (f"token_id:{token_id}" if self.as_token_ids else string), raw

    def format(self, token_ids: list[int], lp: Logprobs) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": self._chat(token_ids, lp), "refusal": None}
        return self._legacy(token_ids, lp)

    def _chat(self, token_ids: list[int], lp: Logprobs) -> list[dict[str, Any]]:
        out = []
        for token_id, value, top_ids, top_values in zip(token_ids, lp.token_logprobs, lp.top_token_ids,
                                                        lp.top_logprobs):
            token, raw = self._token(token_id)
            top = []
            for alt_id, alt_value in zip(top_ids, top_values):
                alt, alt_raw = self._token(alt_id)
                top.append({"token": alt, "logprob": alt_value, "bytes": alt_raw})
            out.append({"token": token, "logprob": value, "bytes": raw, "top_logprobs": top})
        return out

    def _legacy(self, token_ids: list[int], lp: Logprobs) -> dict[str, Any]:
        tokens, offsets, tops = [], [], []
        for token_id, top_ids, top_values in zip(token_ids, lp.top_token_ids, lp.top_logprobs):
            token, _ = self._token(token_id)
            tokens.append(token)
            offsets.append(self.text_offset)
            self.text_offset += len(self.texts.text(token_id)[0])
            tops.append({self._token(i)[0]: v for i, v in zip(top_ids, top_values)})
        return {"tokens": tokens, "token_logprobs": list(lp.token_logprobs), "top_logprobs": tops,
                "text_offset": offsets}
