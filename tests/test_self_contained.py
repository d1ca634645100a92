"""The repository stands alone: no source, test, benchmark or document reaches outside the checkout
for data or documentation, and every document the code and docs cite exists in it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("core", "kernels", "adapters", "model_repository", "bench", "tests", "docs", "deploy", "scripts")
SUFFIXES = {".py", ".md", ".sh", ".toml", ".pbtxt", ".yaml", ".json", ".cpp", ".h"}
OUTSIDE = re.compile(r"\.\./shared|/work/|ROOT\.parent|\bDESIGN\.md|\bCONTRACTS\.md|shared folder")
DOC_REF = re.compile(r"\bdocs/([A-Za-z0-9_]+\.md)")
MD_LINK = re.compile(r"\]\(([^)#:\s]+\.md)(?:#[^)]*)?\)")


def files() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in FOLDERS:
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES and p.is_file()
                  and "data" not in p.relative_to(ROOT).parts and "__pycache__" not in p.parts]
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


def test_the_checks_see_a_violation(tmp_path):
    assert OUTSIDE.search('CRD_DIR = ROOT.parent / "shared" / "kserve-crds"')
    assert OUTSIDE.search("see DESIGN.md rule 5") and OUTSIDE.search("--workload ../shared/workloads/w64.json")
    assert DOC_REF.findall("(docs/design.md, rule 5)") == ["design.md"]
    assert MD_LINK.findall("[design.md](design.md#what-adapters-may-call) [x](https://a.b/c.md)") == ["design.md"]
