"""The suite collects as one: pytest imports test modules outside packages by their file name (rootdir
"prepend" mode), so two such files with one name in different folders stop the whole run at collection."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).parent


def test_test_modules_outside_packages_have_unique_names():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name != "conftest.py" and not (path.parent / "__init__.py").exists():
            by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
