"""The process boundary is visible in the imports: the engine never imports trio, quart or
hypercorn; the frontend never imports torch or the engine's internals; the kernels import
nothing of tidal; ``tidal.wire`` is the one module both sides share.

Every import form counts: ``import tidal.x``, ``from tidal import x``, ``from tidal.x import y``,
relative imports (resolved against the file's package), and ``importlib.import_module`` /
``__import__`` of a literal name, anywhere in the file (functions included).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tidal"
FRONTEND_ONLY = {"trio", "quart", "quart_trio", "hypercorn", "trio_websocket", "h11", "wsproto"}
ENGINE_ONLY = {"torch", "triton", "safetensors"}


def package_of(path: pathlib.Path) -> str:
    """``tidal/gpu/model/llama.py`` -> ``tidal.gpu.model.registry`` (a package's __init__ is its own package)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1])


def imported_modules(source: str, package: str) -> set[str]:
    """Every module name ``source`` may import, absolute. ``from a import b`` gives both ``a``
    and ``a.b`` (b may be a submodule)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__") and not node.args[0].value.startswith("."):
                names.add(node.args[0].value)
    return names


def modules_of(path: pathlib.Path) -> set[str]:
    return imported_modules(path.read_text(), package_of(path))


def top(name: str) -> str:
    return name.split(".")[0]


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def engine_violations(names: set[str]) -> list[str]:
    return [name for name in sorted(names)
            if top(name) in FRONTEND_ONLY
            or (top(name) == "tidal" and name != "tidal"
                and not within(name, "tidal.gpu", "tidal.kernels", "tidal.wire"))]


def frontend_violations(names: set[str]) -> list[str]:
    return [name for name in sorted(names) if top(name) in ENGINE_ONLY or within(name, "tidal.gpu", "tidal.kernels")]


def kernel_violations(names: set[str]) -> list[str]:
    return [name for name in sorted(names) if top(name) == "tidal" and not within(name, "tidal.kernels")]


@pytest.mark.parametrize("source", [
    "import tidal.frontend",
    "import tidal.frontend as f",
    "from tidal import frontend",
    "from tidal import wire, api",
    "from tidal.mailbox import Mailbox",
    "from .. import frontend",
    "from ..streaming import OutputReader",
    "import trio",
    "from quart import websocket",
    "def later():\n    import hypercorn.trio",
    "import importlib\nimportlib.import_module('tidal.engines.client')",
    "__import__('trio')",
])
def test_the_engine_check_sees_every_import_form(source):
    assert engine_violations(imported_modules(source, "tidal.gpu")), source


@pytest.mark.parametrize("source", [
    "from tidal import wire", "from tidal.wire import StepReport", "import tidal.wire", "from .. import wire",
    "from . import sampler", "from .models import llama", "from tidal import kernels", "import torch",
])
def test_the_engine_may_import_itself_the_kernels_and_the_wire(source):
    assert engine_violations(imported_modules(source, "tidal.gpu")) == [], source


@pytest.mark.parametrize("source", [
    "from tidal import gpu", "import tidal.gpu.engine", "from tidal.gpu.sampler import Sampler",
    "from .gpu import engine", "from . import kernels", "import torch", "from triton import language",
])
def test_the_frontend_check_sees_every_import_form(source):
    assert frontend_violations(imported_modules(source, "tidal")), source


@pytest.mark.parametrize("source", ["from tidal import wire", "from .. import wire", "import tidal.gpu",
                                    "from tidal.gpu import attention"])
def test_the_kernel_check_sees_every_import_form(source):
    assert kernel_violations(imported_modules(source, "tidal.kernels")), source


def test_engine_never_imports_the_frontend_stack():
    for path in (PACKAGE / "gpu").rglob("*.py"):
        assert engine_violations(modules_of(path)) == [], f"{path.relative_to(PACKAGE)}: shares tidal.wire only"


def test_frontend_never_imports_torch_or_engine_internals():
    engine_side = (PACKAGE / "gpu", PACKAGE / "kernels")
    for path in PACKAGE.rglob("*.py"):
        if not any(side in path.parents for side in engine_side):
            assert frontend_violations(modules_of(path)) == [], f"{path.relative_to(PACKAGE)}"


def test_kernels_import_nothing_of_tidal():
    for path in (PACKAGE / "kernels").rglob("*.py"):
        assert kernel_violations(modules_of(path)) == [], f"{path.relative_to(PACKAGE)}"


def test_running_the_frontend_does_not_load_torch():
    code = ("import sys, tidal.server, tidal.cli, tidal.tools.bench, tidal.tools.ws_client; "
            "bad = [m for m in ('torch', 'tidal.gpu', 'triton') if m in sys.modules]; print(bad); assert not bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """tidal's modules and the tidal modules each imports, every form counted (type-only and
    function-local imports included)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: {m for m in modules_of(path) if m in modules and m != name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as the list of its modules (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_check_finds_a_cycle_through_a_function_local_import():
    graph = {"a": imported_modules("import b", "x"), "b": imported_modules("def f():\n    from c import y", "x"),
             "c": imported_modules("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a", "x")}
    graph = {name: {m for m in names if m in graph} for name, names in graph.items()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    graph["c"] = set()
    assert find_cycle(graph) is None


def test_no_import_cycles_anywhere_in_tidal():
    assert find_cycle(import_graph()) is None


# the modules directly in tidal/ that every layer may import; the rest of tidal/'s own modules
# (the server, the CLI) are the top floor
TOP_FLOOR = ("tidal.server", "tidal.cli", "tidal.__main__")


def test_the_frontend_layers_point_down():
    """The ground floor (tidal/'s own modules: errors, wire, config, tokenizer, ...) imports nothing
    but itself; the transport hands the service its socket writer (only http/ and the server import
    http/), the service knows no API but the chat shape it reads bodies into, the registry and
    observation know no service, and Anthropic's API borrows nothing from OpenAI's: what they share
    is in tidal/service/."""
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        names = modules_of(path)
        if path.parent == PACKAGE and not within(name, *TOP_FLOOR):
            violations += [f"{name} -> {n}" for n in sorted(names) if within(n, "tidal") and not on_ground_floor(n)]
        if not within(name, "tidal.http", "tidal.server"):
            violations += [f"{name} -> {n}" for n in sorted(names) if within(n, "tidal.http")]
        if within(name, "tidal.anthropic"):
            violations += [f"{name} -> {n}" for n in sorted(names) if within(n, "tidal.openai")]
        if within(name, "tidal.service", "tidal.registry", "tidal.observe"):
            allowed = ("tidal.openai.requests", "tidal.openai.token_logprobs") if within(name, "tidal.service") else ()
            violations += [f"{name} -> {n}" for n in sorted(names)
                           if within(n, "tidal.openai", "tidal.anthropic", "tidal.http", "tidal.server")
                           and not within(n, *allowed) and n != "tidal.openai"]
        if within(name, "tidal.registry", "tidal.observe"):
            violations += [f"{name} -> {n}" for n in sorted(names) if within(n, "tidal.service")]
    assert violations == []


def on_ground_floor(name: str) -> bool:
    """``name`` (a module, or a name in one) is tidal/'s own module other than the top floor's, or tidal itself."""
    parts = name.split(".")
    if len(parts) == 1:
        return True
    module = ".".join(parts[:2])
    return (PACKAGE / f"{parts[1]}.py").is_file() and not within(module, *TOP_FLOOR)
