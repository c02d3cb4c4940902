"""The committed stubs in actcache/_proto are exactly what proto/generate.py produces."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_current(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)], check=True, capture_output=True)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "actcache" / "_proto").iterdir() if p.is_file()}
    committed = {p.name: p.read_bytes() for p in (ROOT / "actcache" / "_proto").iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "stub files differ; run `python proto/generate.py`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}; run `python proto/generate.py` and commit the result"
