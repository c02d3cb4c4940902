"""actcache_client.plot draws a timeline to a PNG, and says what to install without matplotlib."""

from __future__ import annotations

import math
import sys

import pytest

from actcache_client import plot
from actcache_client.freeze import Timeline


def synthetic_timeline(path) -> None:
    timeline = Timeline(path)
    shares = {0: 1.0, 1: 0.9, 2: 0.6}
    frozen, step = 0, 0
    for i in range(40):
        step += 10
        decision = "freeze_next" if i in (15, 30) else "none"
        value = math.exp(-(i % 15) / 3) + 0.1
        after = frozen + (decision == "freeze_next")
        timeline.write({"event": "evaluation", "step": step, "stage": frozen, "stage_name": f"s{frozen}",
                        "signal": "plasticity", "value": value, "decision": decision, "frozen": after,
                        "active_param_share": shares[after], "numbers": {"smoothed": value + 0.01}})
        frozen = after
    timeline.write({"event": "reference", "step": 5, "stage": 0, "ms_per_batch": 1.5})
    timeline.close()


def test_plot_writes_a_png_from_a_timeline_file(tmp_path):
    synthetic_timeline(tmp_path / "t.jsonl")
    out = plot.plot_timeline(tmp_path / "t.jsonl", tmp_path / "freeze.png", title="test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert plot.main([str(tmp_path / "t.jsonl"), str(tmp_path / "cli.png")]) == 0
    assert (tmp_path / "cli.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    synthetic_timeline(tmp_path / "t.jsonl")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'actcache\[plot\]'"):
        plot.plot_timeline(tmp_path / "t.jsonl", tmp_path / "x.png")
