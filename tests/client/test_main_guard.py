"""EgeriaPolicy built by a script's top level outside the ``__main__`` guard: one ConfigError naming the guard."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

UNGUARDED = """
    from actcache_client.freeze.defaults import default_policy
    from actcache_client.freeze.egeria import EgeriaPolicy

    policy = {make}
    print("training", flush=True)
"""

GUARDED = """
    from actcache_client.freeze.defaults import default_policy
    from actcache_client.freeze.egeria import EgeriaPolicy


    def main():
        policy = {make}
        print("training", type(policy).__name__, flush=True)


    if __name__ == "__main__":
        main()
"""

MAKERS = {"EgeriaPolicy": "EgeriaPolicy()", "default controller": "default_policy(100_000, 4)[0]"}


def run(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("make", list(MAKERS.values()), ids=list(MAKERS))
def test_an_unguarded_script_is_one_config_error_naming_the_guard(tmp_path, make):
    out = run(tmp_path, UNGUARDED.format(make=make))
    assert out.returncode != 0 and "training" not in out.stdout
    assert out.stderr.count("actcache.errors.ConfigError: ") == 1, out.stderr
    assert "imports " + str(tmp_path / "train.py") + " again and would run its training again from line 5" in out.stderr
    assert 'put the script\'s training under `if __name__ == "__main__":`' in out.stderr


@pytest.mark.parametrize("make", list(MAKERS.values()), ids=list(MAKERS))
def test_a_guarded_script_builds_it(tmp_path, make):
    out = run(tmp_path, GUARDED.format(make=make))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "training EgeriaPolicy"


def test_python_dash_c_has_no_script_to_import_again():
    out = subprocess.run([sys.executable, "-c", "from actcache_client.freeze.egeria import EgeriaPolicy; EgeriaPolicy()"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
