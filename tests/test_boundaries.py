"""The process boundary is visible in the imports: the engine never imports trio, quart or
hypercorn; the frontend never imports torch or the engine's internals; the kernels import
nothing of tidal; ``tidal.wire`` is the one module both sides share."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tidal"
FRONTEND_ONLY = {"trio", "quart", "quart_trio", "hypercorn", "trio_websocket", "h11", "wsproto"}
ENGINE_ONLY = {"torch", "triton", "safetensors"}


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def top(name: str) -> str:
    return name.split(".")[0]


def test_engine_never_imports_the_frontend_stack():
    for path in (PACKAGE / "gpu").rglob("*.py"):
        for name in imported_modules(path):
            assert top(name) not in FRONTEND_ONLY, f"{path.name} imports {name}"
            if name.startswith("tidal.") and not name.startswith(("tidal.gpu", "tidal.kernels")):
                assert name == "tidal.wire", f"{path.name} imports {name}: the engine shares only tidal.wire"


def test_frontend_never_imports_torch_or_engine_internals():
    for path in PACKAGE.glob("*.py"):
        for name in imported_modules(path):
            assert top(name) not in ENGINE_ONLY, f"{path.name} imports {name}"
            assert not name.startswith(("tidal.gpu", "tidal.kernels")), f"{path.name} imports {name}"


def test_kernels_import_nothing_of_tidal():
    for path in (PACKAGE / "kernels").rglob("*.py"):
        for name in imported_modules(path):
            assert top(name) != "tidal", f"{path.name} imports {name}"


def test_running_the_frontend_does_not_load_torch():
    code = ("import sys, tidal.server, tidal.cli, tidal.bench, tidal.ws_client; "
            "bad = [m for m in ('torch', 'tidal.gpu', 'triton') if m in sys.modules]; print(bad); assert not bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
