"""scripts/setup.sh on a complete environment: the stamp says what was installed, so pip does not
run again; a forced run does. pip is replaced by a stand-in that records its calls (PYTHONPATH puts
it before the real one), so the test never touches the installed packages."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAMP = ROOT / ".venv" / ".pagedserve-setup"

pytestmark = pytest.mark.skipif(not STAMP.is_file(), reason="needs an environment set up by scripts/setup.sh")


def run_setup(tmp_path: Path, **env: str) -> tuple[int, list[str]]:
    fake = tmp_path / "fake"
    (fake / "pip").mkdir(parents=True, exist_ok=True)
    calls = tmp_path / "pip-calls"
    calls.unlink(missing_ok=True)
    (fake / "pip" / "__init__.py").write_text("")
    (fake / "pip" / "__main__.py").write_text(
        f"import sys\nopen({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\nsys.exit(3)\n")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(fake), **env})
    return proc.returncode, calls.read_text().splitlines() if calls.exists() else []


def test_complete_environment_skips_pip_and_a_forced_run_does_not(tmp_path):
    stamp = STAMP.read_text()
    try:
        code, calls = run_setup(tmp_path)
        assert code == 0 and calls == []
        code, calls = run_setup(tmp_path, PAGEDSERVE_SETUP_FORCE="1")
        assert code != 0 and calls and calls[0].startswith("--disable-pip-version-check -q install")
        assert not STAMP.exists()  # a failed install leaves no stamp: the next run installs again
    finally:
        STAMP.write_text(stamp)
    code, calls = run_setup(tmp_path)
    assert code == 0 and calls == []
