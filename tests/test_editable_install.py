"""The development install (scripts/setup.sh: `pip install -e .`) is one a static tool can follow.

Editors, pyright, jedi and pylint find modules by reading the path lines of the .pth files in
site-packages and looking for files there; they never run the `import ...` lines a .pth may also
hold. setuptools writes a plain path line (naming src/) only when every package lies where its
name says; a layout it cannot express that way gets an import hook instead (an `import
__editable___..._finder` line), which only a running interpreter follows. So the checks below read
the installed distribution's .pth files as a static tool does, resolve modules from them by file
lookup alone, and hold the result against what the interpreter imports.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MODULES = ("pagedserve", "pagedserve.core.engine", "pagedserve.kernels.cpu.build",
           "pagedserve.adapters.triton_server.model", "pagedserve.adapters.kserve.server")


def installed() -> importlib.metadata.Distribution:
    """The pagedserve pip installed into this environment's site-packages (the egg-info setuptools
    leaves in src/ describes the same install, but static tools read site-packages)."""
    (dist,) = importlib.metadata.Distribution.discover(name="pagedserve", path=[sysconfig.get_path("purelib")])
    return dist


def pth_lines() -> list[str]:
    """Every line of the .pth files the pagedserve distribution installed."""
    dist = installed()
    pth = [f for f in dist.files or () if f.suffix == ".pth"]
    assert pth, f"pagedserve installed no .pth file: not an editable install ({dist.files})"
    return [line.strip() for f in pth for line in Path(dist.locate_file(f)).read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def static_resolve(module: str, roots: list[Path]) -> Path | None:
    """A module's file found as a static tool finds it: the first root holding it as a file."""
    parts = module.split(".")
    for root in roots:
        for candidate in (root.joinpath(*parts, "__init__.py"), root.joinpath(*parts).with_suffix(".py")):
            if candidate.is_file():
                return candidate
    return None


def test_this_checkout_is_installed_editable():
    direct_url = json.loads(installed().read_text("direct_url.json") or "{}")
    assert direct_url.get("dir_info", {}).get("editable"), "run scripts/setup.sh (pip install -e .)"
    assert Path(direct_url["url"].removeprefix("file://")).resolve() == ROOT


def test_the_editable_hook_is_a_path_entry_not_an_import_hook():
    lines = pth_lines()
    assert not [line for line in lines if line.startswith("import")], lines
    assert [Path(line).resolve() for line in lines] == [SRC]


def test_static_lookup_finds_what_python_imports():
    roots = [Path(line) for line in pth_lines()]
    for module in MODULES:
        found = static_resolve(module, roots)
        assert found is not None, f"{module} is not reachable from the .pth paths {roots}"
        assert found.resolve() == Path(importlib.util.find_spec(module).origin).resolve(), module
        assert found.resolve().is_relative_to(SRC / "pagedserve"), found


def test_static_lookup_can_fail(tmp_path):
    """The lookup above is no formality: a package mapped from elsewhere is not found from src/."""
    (tmp_path / "pagedserve" / "core").mkdir(parents=True)
    (tmp_path / "pagedserve" / "core" / "__init__.py").write_text("")
    assert static_resolve("pagedserve.core.engine", [tmp_path]) is None
    assert static_resolve("pagedserve.core", [tmp_path]) == tmp_path / "pagedserve" / "core" / "__init__.py"
