"""ResponseStore's three bounds (docs/admission.md): entries, age and bytes kept, oldest out first."""

from __future__ import annotations

from tidal.openai.response_store import ResponseStore, stored_size


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_at_most_max_entries_the_oldest_evicted():
    store = ResponseStore(max_entries=2, max_age=100, max_bytes=1000)
    for i in range(3):
        store.put({"id": f"r{i}"}, turn("x"))
    assert store.get("r0") is None and store.get("r1") and store.get("r2") and len(store) == 2


def test_entries_older_than_max_age_are_gone():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_age=60, max_bytes=1000, clock=clock)
    store.put({"id": "old"}, turn("x"))
    clock.now = 30
    store.put({"id": "new"}, turn("x"))
    clock.now = 60
    assert store.get("old") is not None  # exactly at the limit: kept
    clock.now = 60.5
    assert store.get("old") is None and store.get("new") is not None


def test_the_bytes_kept_are_bounded_and_an_oversized_entry_never_stored():
    unit = stored_size({"id": "a"}, turn(""))  # an entry with empty text
    store = ResponseStore(max_entries=10, max_age=100, max_bytes=2 * unit + 10)
    store.put({"id": "a"}, turn("x" * 6))
    store.put({"id": "b"}, turn("y" * 4))
    assert store.num_bytes == 2 * unit + 10 and store.get("a") and store.get("b")
    store.put({"id": "c"}, turn("z"))
    assert store.get("a") is None and store.num_bytes == 2 * unit + 5
    store.put({"id": "huge"}, turn("w" * (unit + 11)))
    assert store.get("huge") is None and store.get("b") and store.get("c")


def test_everything_an_entry_keeps_is_counted_not_only_its_text():
    """metadata, tools, instructions, user and empty messages were kept uncounted (+336 MiB for 40 requests)."""
    bare = stored_size({"id": "r"}, turn("hi"))
    response = {"id": "r", "instructions": "i" * 1000, "user": "u" * 1000, "metadata": {"k": "v" * 512},
                "tools": [{"type": "function", "name": "f", "parameters": {"enum": ["x" * 1000]}}]}
    assert stored_size(response, turn("hi")) > bare + 3500
    empties = [{"role": "user", "content": ""}] * 1000
    assert stored_size({"id": "r"}, empties) > 1000 * len('{"role":"user","content":""}')
    store = ResponseStore(max_entries=1000, max_age=100, max_bytes=40_000)
    for i in range(40):
        store.put({**response, "id": f"r{i}"}, turn("hi"))
    assert store.num_bytes <= 40_000 and len(store) < 40
