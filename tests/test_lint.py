"""`make test` runs ruff and mypy before pytest, and a finding of either fails it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make(*args: str) -> subprocess.CompletedProcess:
    # -o: take the installed environment as it is (never rebuild the venv from a test)
    return subprocess.run(["make", "--no-print-directory", "-o", f"{BIN}/.installed", "-o", f"{BIN}/.minilm",
                           f"BIN={BIN}", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("target", ["test", "test-fast"])
def test_make_test_runs_ruff_and_mypy_before_pytest(target):
    commands = _make("-n", target).stdout.splitlines()
    ruff = next(i for i, c in enumerate(commands) if "ruff check" in c)
    mypy = next(i for i, c in enumerate(commands) if c.startswith(f"{BIN}/mypy "))
    pytest_ = next(i for i, c in enumerate(commands) if "-m pytest" in c)
    assert ruff < pytest_ and mypy < pytest_, commands
    assert ("-m \"not slow\"" in commands[pytest_]) == (target == "test-fast")


def test_a_ruff_or_mypy_finding_fails_the_lint_recipe(tmp_path):
    clean = tmp_path / "clean.py"
    clean.write_text("def double(n: int) -> int:\n    return 2 * n\n")
    unused_import = tmp_path / "unused_import.py"
    unused_import.write_text("import os\n")
    wrong_type = tmp_path / "wrong_type.py"
    wrong_type.write_text("count: int = 'three'\n")

    assert _make("lint", f"RUFF_PATHS={clean}", f"MYPY_PATHS={clean}").returncode == 0
    ruff = _make("lint", f"RUFF_PATHS={unused_import}", f"MYPY_PATHS={clean}")
    assert ruff.returncode != 0 and "F401" in ruff.stdout, ruff.stdout + ruff.stderr
    mypy = _make("lint", f"RUFF_PATHS={clean}", f"MYPY_PATHS={wrong_type}")
    assert mypy.returncode != 0 and "[assignment]" in mypy.stdout, mypy.stdout + mypy.stderr
