"""Egeria's Figure 11 from a freeze timeline: plasticity per stage, and the share of active parameters.

    python -m actcache_client.plot timeline.jsonl freeze.png

Top panel: each stage's signal at every evaluation (plasticity for Egeria, eta for AutoFreeze) with its
smoothed curve, freezes and unfreezes marked. Bottom panel: the share of parameters still trained over
steps. Needs matplotlib (``pip install 'actcache[plot]'``), imported only when plotting, drawn with the
Agg canvas (no display or global backend).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actcache_client.freeze.timeline import read_timeline

__all__ = ["main", "plot_timeline"]


def plot_timeline(timeline: str | os.PathLike | Sequence[dict[str, Any]], out: str | os.PathLike, *,
                  title: str | None = None) -> Path:
    """Draw a FreezeController timeline.

    Args:
        timeline: The timeline file, or its records.
        out: The image to write (PNG, SVG, PDF by suffix).
        title: The figure's title.

    Returns:
        ``out``'s path.

    Raises:
        ImportError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("actcache_client.plot needs matplotlib: pip install 'actcache[plot]' "
                          "(or pip install matplotlib)") from exc
    records = read_timeline(timeline) if isinstance(timeline, (str, os.PathLike)) else list(timeline)
    evaluations = [r for r in records if r.get("event") == "evaluation"]
    fig = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    signal = next((r["signal"] for r in evaluations if r.get("signal")), "signal")
    stages = sorted({r["stage"] for r in evaluations if r.get("value") is not None})
    for stage in stages:
        rows = [r for r in evaluations if r["stage"] == stage and r.get("value") is not None]
        name = rows[0].get("stage_name") or str(stage)
        points = top.plot([r["step"] for r in rows], [r["value"] for r in rows], ".", alpha=0.4)
        smooth = [(r["step"], r["numbers"]["smoothed"]) for r in rows if r.get("numbers", {}).get("smoothed")]
        if smooth:
            top.plot(*zip(*smooth), "-", color=points[0].get_color(), label=f"stage {stage} ({name})")
        else:
            points[0].set_label(f"stage {stage} ({name})")
    for r in evaluations:
        if r.get("decision") in ("freeze_next", "unfreeze_all"):
            colour = "tab:green" if r["decision"] == "freeze_next" else "tab:red"
            for ax in (top, bottom):
                ax.axvline(r["step"], color=colour, linestyle="--", linewidth=0.8)
    values = [r["value"] for r in evaluations if r.get("value") is not None]
    if values and min(values) > 0 and max(values) / min(values) > 100:
        top.set_yscale("log")  # plasticity spans decades: the first readings after a refresh sit far above
    top.set_ylabel(signal)
    top.set_title(title or f"{signal} per stage (dashed: green freeze, red unfreeze)")
    if stages:
        top.legend(fontsize="small")
    steps = [0] + [r["step"] for r in evaluations]
    share = [1.0] + [r["active_param_share"] for r in evaluations]
    bottom.step(steps, share, where="post")
    bottom.set_ylim(0, 1.05)
    bottom.set_xlabel("step")
    bottom.set_ylabel("active parameters")
    out = Path(out)
    fig.savefig(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m actcache_client.plot TIMELINE OUT [--title TITLE]``.

    Args:
        argv: The arguments; default: ``sys.argv[1:]``.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", type=Path, help="a FreezeController timeline (JSON lines)")
    parser.add_argument("out", type=Path, help="image to write (.png, .svg, .pdf)")
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    print(plot_timeline(args.timeline, args.out, title=args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
