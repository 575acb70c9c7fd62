"""The user docs speak to users: no project-internal vocabulary (issue numbers, work rounds, team notes,
other people's sessions), and every link between them lands on a file and a heading that exist."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Words that only mean something to whoever worked on the project, not to someone running it.
INTERNAL_PHRASES = [
    r"\bissues?[- ]#?\d+",                   # "issue 23", "issue-10", anchors like #gpu-issue-11-item-3
    r"\bthe issue'?s?\b",                    # "the targets": which issue?
    r"\b(this|last|previous) round\b",       # a round of work, not a benchmark round
    r"\bteam notes\b",
    r"\bpitfall P\d",
    r"\b(other|another) (sessions?|helpers?|agents?)\b",  # the people sharing the build host
    r"\bsessions behind\b",
    r"\blent\b",                             # "the GPU lent to this task"
    r"\bthis task\b",
]
_INTERNAL = re.compile("|".join(f"(?:{p})" for p in INTERNAL_PHRASES), re.IGNORECASE)

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose_lines(path: pathlib.Path):
    """(line number, line) outside fenced code blocks."""
    in_fence = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield number, line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(path):
        heading = _HEADING.match(line)
        if not heading:
            continue
        slug = github_slug(heading.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")  # GitHub numbers repeated headings
    return found


def broken_links(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    broken = []
    for number, line in _prose_lines(path):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # http:, mailto: ...
            file_part, _, anchor = target.partition("#")
            if file_part and not file_part.endswith(".md"):
                continue  # an image, an example script: only links between pages carry anchors
            page = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not page.is_file():
                broken.append(f"{where} (no such file)")
            elif anchor and anchor not in anchors(page):
                broken.append(f"{where} (no heading with that anchor)")
    return broken


def test_the_slug_rule_matches_githubs():
    assert github_slug("Choices (`n` > 1)") == "choices-n--1"
    assert github_slug("The hop story: where a request's time goes") == "the-hop-story-where-a-requests-time-goes"
    assert github_slug("Stored responses (`/v1/responses` with `store`)") == "stored-responses-v1responses-with-store"


def test_the_link_check_catches_a_missing_anchor_and_file(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Input bounds\n\n```\n# not a heading\n```\n")
    (tmp_path / "b.md").write_text(
        "[ok](a.md#input-bounds) [old](a.md#input-bounds-issue-23) [gone](c.md) [code](a.md#not-a-heading)\n"
        "[self](#b) [web](https://example.com/x.md#y)\n"
    )
    found = broken_links(tmp_path / "b.md", root=tmp_path)
    assert [entry.split(": ", 1)[1] for entry in found] == [
        "a.md#input-bounds-issue-23 (no heading with that anchor)",
        "c.md (no such file)",
        "a.md#not-a-heading (no heading with that anchor)",
        "#b (no heading with that anchor)",
    ]


def test_the_phrase_list_catches_internal_words_and_spares_benchmark_rounds():
    for internal in ("as in issue 23", "#gpu-issue-11-item-3", "this round's default", "the last round's tree",
                     "pitfall P2 in the team notes", "shared with other sessions", "from other agents", "the GPU lent to this task",
                     "the issue's targets"):
        assert _INTERNAL.search(internal), internal
    for plain in ("tok/s by round", "round 1", "round-to-nearest", "a thread round trip", "ROUNDS=2",
                  "the openai SDK's stream helpers", "a measurement session", "lentils"):
        assert not _INTERNAL.search(plain), plain


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_use_no_internal_vocabulary(path):
    hits = [f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}"
            for number, line in enumerate(path.read_text().splitlines(), 1)
            for match in _INTERNAL.finditer(line)]
    assert not hits, "internal vocabulary in user docs:\n" + "\n".join(hits)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_docs_land_on_a_file_and_heading(path):
    broken = broken_links(path)
    assert not broken, "broken links:\n" + "\n".join(broken)
