"""The repository stands alone: no source, test, benchmark or document reaches outside the checkout
for data or documentation, and every document and file the code and docs cite exists in it.

A cited package file is written from the package root (`core/engine.py`,
`adapters/triton_server/launcher.py`: under src/pagedserve/), anything else from the checkout root
(`bench/common.py`, `src/pagedserve/kernels/cpu/build.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pagedserve"
FOLDERS = ("src", "bench", "tests", "docs", "deploy", "scripts")
SUFFIXES = {".py", ".md", ".sh", ".toml", ".pbtxt", ".yaml", ".json", ".cpp", ".h"}
OUTSIDE = re.compile(r"\.\./shared|/work/|ROOT\.parent|\bDESIGN\.md|\bCONTRACTS\.md|shared folder")
DOC_REF = re.compile(r"\bdocs/([A-Za-z0-9_]+\.md)")
MD_LINK = re.compile(r"\]\(([^)#:\s]+\.md)(?:#[^)]*)?\)")
PACKAGE_FOLDERS = ("core", "kernels", "adapters", "model_repository")
CITED_PATH = re.compile(r"(?<![\w./~-])((?:src/pagedserve|bench|tests|scripts|deploy|" + "|".join(PACKAGE_FOLDERS)
                        + r")/[\w./*-]*[\w*])")
MADE_AT_RUN_TIME = {"bench/.peer-venv"}  # vLLM's side virtualenv (bench/vllm_peer.py), git-ignored


def files() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in FOLDERS:
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES and p.is_file()
                  and "data" not in p.relative_to(ROOT).parts and "__pycache__" not in p.parts
                  and not any(p.is_relative_to(ROOT / made) for made in MADE_AT_RUN_TIME)]
    return [p for p in found if p != Path(__file__).resolve()]


def test_nothing_points_outside_the_checkout():
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files()
           for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert bad == []


def test_every_cited_document_exists():
    missing = []
    for p in files():
        text = p.read_text(errors="replace")
        missing += [f"{p.relative_to(ROOT)}: docs/{name}" for name in DOC_REF.findall(text)
                    if not (ROOT / "docs" / name).is_file()]
        if p.suffix == ".md":
            missing += [f"{p.relative_to(ROOT)}: {link}" for link in MD_LINK.findall(text)
                        if not (p.parent / link).resolve().is_file()]
    assert missing == []


def cited_path_exists(cited: str) -> bool:
    """`core/x.py` under the package, `bench/x.py` under the checkout; a glob matches something;
    `bench/proctree.tree_rss` (a module's attribute) names an existing bench/proctree.py."""
    cited = cited.rstrip(".")
    base = PACKAGE if cited.split("/")[0] in PACKAGE_FOLDERS else ROOT
    if "*" in cited:
        return any(base.glob(cited))
    module, dot, _ = cited.rpartition(".")
    return (base / cited).exists() or bool(dot) and (base / f"{module}.py").is_file()


def test_every_cited_path_exists():
    """Paths in comments and docs still lead somewhere (they went stale once, when files moved)."""
    missing = [f"{p.relative_to(ROOT)}:{i}: {cited}" for p in files()
               for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
               for cited in CITED_PATH.findall(line) if cited not in MADE_AT_RUN_TIME and not cited_path_exists(cited)]
    assert missing == []


def test_the_checks_see_a_violation(tmp_path):
    assert OUTSIDE.search('CRD_DIR = ROOT.parent / "shared" / "kserve-crds"')
    assert OUTSIDE.search("see DESIGN.md rule 5") and OUTSIDE.search("--workload ../shared/workloads/w64.json")
    assert DOC_REF.findall("(docs/design.md, rule 5)") == ["design.md"]
    assert MD_LINK.findall("[design.md](design.md#what-adapters-may-call) [x](https://a.b/c.md)") == ["design.md"]
    cited = CITED_PATH.findall("core/engine.py, bench/common.py (see https://x.org/core/a.py and vllm's src/model.py)")
    assert cited == ["core/engine.py", "bench/common.py"] and all(map(cited_path_exists, cited))
    assert not cited_path_exists("core/layers/norm.py") and not cited_path_exists("src/pagedserve/engine.py")
    assert cited_path_exists("bench/proctree.tree_rss") and cited_path_exists("kernels/cpu/*.cpp")
