"""The guides' examples in examples/ run, and train as the same loop without the cache does."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_text_pairs_with_dict_batches_match_the_plain_loop(daemon, monkeypatch):
    monkeypatch.setenv("ACTCACHE_SOCKET", str(daemon.socket))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import text_pairs

    try:
        losses, hits = text_pairs.train(cached=True)
        assert hits == 32  # epoch 1 computed and stored the 32 pairs' prefix, epoch 2 was served
        assert losses == text_pairs.train(cached=False)[0]
    finally:
        sys.modules.pop("text_pairs", None)
