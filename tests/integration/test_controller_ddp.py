"""Data parallel: two gloo ranks (spawned CPU processes) take rank 0's decisions at the same steps."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import actcache_client as ac
from actcache_client.freeze import AutoFreezePolicy, Decision, FreezeController, read_timeline

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

STEPS = 24


class RankLocal(AutoFreezePolicy):
    """AutoFreeze that, run on rank r alone, would also force a freeze at evaluation 2 + 2r.

    If ranks decided for themselves they would disagree; the controller must
    take rank 0's decisions everywhere. It also records the losses it saw.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.losses: list[float | None] = []
        self.needs = frozenset({"grad_norms", "loss"})

    def observe(self, signals):
        self.calls += 1
        self.losses.append(signals.loss)
        decision = super().observe(signals)
        forced = 2 + 2 * dist.get_rank()
        if decision.kind.value == "none" and self.calls == forced and signals.frozen < signals.num_stages - 1:
            return Decision.freeze(signals.frozen, f"forced on rank {dist.get_rank()}")
        return decision


def _rank_main(rank: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # same initial weights on both ranks
        net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16),
                            nn.ReLU(), nn.Linear(16, 3))
        staged = ac.from_sequential(net, groups=[2, 2, 2, 1])
        cached = ac.CachedForward(staged)
        opt = torch.optim.SGD(staged.parameters(), lr=0.05, momentum=0.9)
        timeline = os.path.join(out_dir, f"timeline-{rank}.jsonl")
        ctl = FreezeController(cached, opt, RankLocal(), eval_every=3, timeline=timeline)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        per_step, local_losses = [], []
        for _step in range(STEPS):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            loss = nn.functional.cross_entropy(cached(torch.arange(8), x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctl.step(loss)
            local_losses.append(loss.item())
            per_step.append(ctl.frozen)
        ctl.close()
        result = {
            "per_step": per_step, "changes": [list(c) for c in ctl.changes], "calls": ctl.policy.calls,
            "seen_losses": ctl.policy.losses, "local_losses": local_losses, "rewrap_s": ctl.rewrap_seconds,
            "params": [p.detach().flatten().tolist() for p in staged.parameters()],
            "ddp": type(cached.suffix_module).__name__,
            "ddp_params": sum(p.numel() for p in cached.suffix_module.parameters()),
        }
        Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    # The rank's work is on disk. Leave without the C++ teardown at interpreter exit, which aborted a
    # gloo rank now and then ("terminate called without an active exception", after its results).
    os._exit(0)


def test_two_ranks_switch_at_the_same_steps_with_rank_zeros_decisions(tmp_path):
    mp.spawn(_rank_main, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2))
    assert r0["per_step"] == r1["per_step"] and r0["changes"] == r1["changes"]
    assert r0["changes"], "rank 0's forced freeze at evaluation 2 was applied"
    step, before, after = r0["changes"][0]
    assert (step, before) == (6, 0) and after >= 1  # evaluation 2 (step 6): rank 0's forced freeze, not rank 1's
    assert r1["calls"] == 0 and r0["calls"] >= STEPS // 3  # only rank 0 runs the policy
    # Signals are reduced across ranks: rank 0 saw the mean of both ranks' interval losses.
    for i, seen in enumerate(r0["seen_losses"][:2]):
        window = slice(3 * i, 3 * i + 3)
        expected = (sum(r0["local_losses"][window]) + sum(r1["local_losses"][window])) / 6
        assert abs(seen - expected) < 1e-5
    # DDP wraps only the active stages, re-wrapped at each change, and kept the ranks identical.
    assert r0["ddp"] == "DistributedDataParallel" and r0["rewrap_s"] is not None and r0["rewrap_s"] >= 0
    frozen = r0["per_step"][-1]
    assert r0["ddp_params"] < sum(len(p) for p in r0["params"]) or frozen == 0
    assert all(a == b for a, b in zip(r0["params"], r1["params"]))
    records = read_timeline(tmp_path / "timeline-0.jsonl")
    changed = [r for r in records if r.get("rewrap_s") is not None]
    assert len(changed) == len(r0["changes"]) and all(r["rewrap_s"] >= 0 for r in changed)
    assert not (tmp_path / "timeline-1.jsonl").exists()  # rank 0 alone writes the timeline
