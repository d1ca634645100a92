"""The import rules of docs/design.md, read from the source (ast), so a violation fails here even
where no test happens to import the offending module:

* core/ and kernels/ import no adapter, no tool and no platform package, not even lazily or by
  name (importlib with a string);
* adapters never import LLMEngine: they serve through AsyncLLMEngine; offline commands that drive
  LLMEngine are tools/;
* kernels/ import nothing from core/ (numerics only);
* adapters import no private name (`_x`) from core: what they need is core's public API;
* nothing imports the bare folder names `core`, `kernels`, `adapters` (PyPI has packages by those names);
* the package imports nothing from tests/ (its harness) or bench/;
* core has no import cycle (scheduler and policies were one).

core/, kernels/, adapters/, tools/ and model_repository/ are the package's folders, under src/pagedserve/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pagedserve"
PLATFORMS = ("tritonserver", "triton_python_backend_utils", "tritonclient", "pytriton", "kserve", "pydantic",
             "fastapi", "starlette", "uvicorn", "prometheus_client", "grpc")


def sources(folder: str) -> list[Path]:
    """The Python files of a package folder (src/pagedserve/<folder>) or of bench/ and tests/; not
    those of hidden folders (bench/.peer-venv, the vLLM virtualenv a benchmark installs)."""
    base = ROOT / folder if folder in ("bench", "tests") else PACKAGE / folder
    assert base.is_dir(), base
    return sorted(p for p in base.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(base).parts))


def imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, module, imported names) of every import statement, plus string constants that name a
    pagedserve module (importlib.import_module targets)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("pagedserve."):
            found.append((node.lineno, node.value, ()))
    return found


def top(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("folder", ["core", "kernels"])
def test_the_engine_imports_no_adapter_and_no_platform(folder):
    bad = [f"{p.relative_to(ROOT)}:{line}: {module}" for p in sources(folder) for line, module, _ in imports(p)
           if module.startswith(("pagedserve.adapters", "pagedserve.tools")) or top(module) in PLATFORMS
           or (folder == "kernels" and module.startswith("pagedserve.core"))]
    assert bad == []


def test_adapters_never_drive_the_engine_directly():
    bad = [f"{p.relative_to(ROOT)}:{line}: {module} {names}" for p in sources("adapters")
           for line, module, names in imports(p)
           if module == "pagedserve.core.engine" and "LLMEngine" in names]
    assert bad == []


def test_adapters_use_only_the_public_api_of_core():
    bad = [f"{p.relative_to(ROOT)}:{line}: {module} {name}" for p in sources("adapters")
           for line, module, names in imports(p) if module.startswith("pagedserve.core")
           for name in names if name.startswith("_")]
    assert bad == []


@pytest.mark.parametrize("folder", ["core", "kernels", "adapters", "tools", "model_repository", "bench", "tests"])
def test_nothing_imports_the_bare_folder_names(folder):
    bad = [f"{p.relative_to(ROOT)}:{line}: {module}" for p in sources(folder) for line, module, _ in imports(p)
           if top(module) in ("core", "kernels", "adapters")]
    assert bad == []


@pytest.mark.parametrize("folder", ["core", "kernels", "adapters", "tools", "model_repository"])
def test_the_package_needs_no_test_harness(folder):
    """Starting servers for tests and benchmarks (tests/harness) is not part of the product."""
    bad = [f"{p.relative_to(ROOT)}:{line}: {module}" for p in sources(folder) for line, module, _ in imports(p)
           if top(module) in ("tests", "harness", "bench")]
    assert bad == []


def sys_path_edits(path: Path) -> list[int]:
    """Lines that change sys.path: a call on it (insert, append, ...) or an assignment to it."""
    def is_sys_path(node: ast.AST) -> bool:
        node = node.value if isinstance(node, ast.Subscript) else node
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            found.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [node.lineno for target in targets if is_sys_path(target)]
    return sorted(found)


@pytest.mark.parametrize("folder", ["core", "kernels", "adapters", "tools", "model_repository", "bench", "tests"])
def test_nothing_edits_sys_path(folder):
    """Imports resolve from the install (src/ on a .pth path line) and, for tests and benchmarks,
    from the checkout root that pytest's pythonpath or `python -m bench.X` provides (docs/design.md)."""
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in sources(folder) for line in sys_path_edits(p)]
    assert bad == []


def test_the_rules_catch_a_violation(tmp_path):
    """The checks above can fail: a lazy adapter import and a private core name are both seen."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import importlib\n    from pagedserve.core.cli import _engine_args\n"
                     "    return importlib.import_module('pagedserve.adapters.kserve.server')\n")
    found = imports(probe)
    assert (3, "pagedserve.core.cli", ("_engine_args",)) in found
    assert (4, "pagedserve.adapters.kserve.server", ()) in found
    probe.write_text("import sys\nsys.path.insert(0, 'x')\nsys.path += ['y']\nsys.path[:0] = ['z']\n"
                     "print(sys.path[0])\n")
    assert sys_path_edits(probe) == [2, 3, 4]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles(folder: str) -> list[list[str]]:
    """Cycles among a package folder's modules, counting every import (lazy and TYPE_CHECKING ones
    too: a cycle there still means two modules that cannot be understood apart)."""
    paths = sources(folder)
    names = {module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for p in paths:
        here = module_name(p)
        targets = set()
        for _, module, imported in imports(p):
            # `from package import submodule` depends on the submodule, not on the package's body
            submodules = {f"{module}.{n}" for n in imported} & names
            targets |= {c for c in (submodules or {module}) if c in names and c != here}
        graph[here] = targets
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_core_has_no_import_cycle():
    assert import_cycles("core") == []
