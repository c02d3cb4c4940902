"""Controller overhead: ResNet-20 steps/s with the Egeria policy (reference process running) vs without.

    python bench/bench_controller.py [--quick] [--batch 64] [--rounds 8] [--steps 40] [--eval-every 20] [--threads 1]

Same model, same data, same process, nothing frozen (the policy's tolerance
is set so low that it never freezes: this measures the cost of watching, not
the gain of freezing). The two modes alternate in blocks of ``--steps``
steps, ``--rounds`` times, so machine drift hits both alike. "egeria" runs
the controller's hooks every step and an evaluation every ``--eval-every``
steps: one probe per interval copied to the reference process (fp32, a
spawned CPU process with 1 thread), the snapshot refreshed every W=10
evaluations. Training uses ``--threads`` torch threads (default 1: on a
shared 2-core machine two OpenMP threads ran a ResNet-20 step 10-30x slower
than one), so the reference process has the other core, as Egeria assumes
spare CPU cores. Sample output (2 shared cores, --quick):

    ResNet-20 (11 stages, 0 frozen), batch 32, 6 rounds x 12 steps per mode, eval every 6, 1 training threads; ...
    mode      steps/s   ms/step   per round (ms/step)
    off          5.59     178.9   183 180 188 180 178 164
    egeria       5.83     171.5   193 185 180 160 146 166
    reference (measured rounds): 12 readings, 0 skipped (queue full), 0 skipped (CPU busy); stage 0 at ... ms a batch
    time with / without: 0.958 over all rounds; per round 0.817 0.890 0.956 1.012 1.025 1.052 (median below: ...)
    figure: egeria_overhead = 0.984
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

import actcache_client as ac
from actcache_client.freeze import EgeriaConfig, EgeriaPolicy, FreezeController, ReferenceConfig
from actcache_client.models import resnet20

WARMUP_WAIT_S = 120.0


def block(cached: ac.CachedForward, opt: torch.optim.Optimizer, ctl: FreezeController | None,
          data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Seconds for one pass over ``data``; with ``ctl`` its hooks run as in a real loop."""
    start = time.perf_counter()
    for i, (x, y) in enumerate(data):
        loss = nn.functional.cross_entropy(cached(range(i, i + len(x)), x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if ctl is not None:
            ctl.after_backward()
        opt.step()
        if ctl is not None:
            ctl.step(loss)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8, help="alternations of the two modes")
    parser.add_argument("--steps", type=int, default=40, help="steps per mode per round")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between evaluations (Egeria's n)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.rounds, args.steps, args.eval_every = 32, 6, 12, 6
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    staged = ac.from_resnet(resnet20())
    cached = ac.CachedForward(staged)
    opt = torch.optim.SGD(staged.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(args.batch, 3, 32, 32, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
            for _ in range(args.steps)]
    policy = EgeriaPolicy(EgeriaConfig(bootstrap_threshold=None, tolerance_fraction=1e-12))
    reference = ReferenceConfig(max_cpu_percent=None)
    with FreezeController(cached, opt, policy, eval_every=args.eval_every, reference=reference,
                          hook_optimizer=False) as ctl:
        # Warm-up: both modes once, and the reference process up with stage 0 built.
        warm_start = time.perf_counter()
        block(cached, opt, None, data[:4])
        deadline = time.monotonic() + WARMUP_WAIT_S
        while not ctl.reference_stats.builds and time.monotonic() < deadline:
            block(cached, opt, ctl, data[: args.eval_every])
        warmup_s = time.perf_counter() - warm_start
        times: dict[str, list[float]] = {"off": [], "egeria": []}
        stats_before = dict(vars(ctl.reference_stats))
        for _ in range(args.rounds):
            times["off"].append(block(cached, opt, None, data))
            times["egeria"].append(block(cached, opt, ctl, data))
        stats = ctl.reference_stats
        frozen = ctl.frozen
    steps = args.rounds * args.steps
    per_step = {mode: 1e3 * sum(t) / steps for mode, t in times.items()}
    print(f"ResNet-20 ({staged.num_stages} stages, {frozen} frozen), batch {args.batch}, {args.rounds} rounds x "
          f"{args.steps} steps per mode, eval every {args.eval_every}, {torch.get_num_threads()} training threads; "
          f"warm-up (reference process up, stage 0 built) {warmup_s:.1f} s")
    print(f"{'mode':<8}{'steps/s':>9}{'ms/step':>10}   per round (ms/step)")
    for mode, t in times.items():
        rounds = " ".join(f"{1e3 * x / args.steps:.0f}" for x in t)
        print(f"{mode:<8}{1e3 / per_step[mode]:>9.2f}{per_step[mode]:>10.1f}   {rounds}")
    built = stats.builds[0] if stats.builds else {}
    print(f"reference (measured rounds): {stats.readings - stats_before['readings']} readings, "
          f"{stats.skipped_full - stats_before['skipped_full']} skipped (queue full), "
          f"{stats.skipped_busy - stats_before['skipped_busy']} skipped (CPU busy); stage 0 at "
          f"{built.get('ms_per_batch', float('nan')):.2f} ms a batch")
    paired = sorted(e / o for e, o in zip(times["egeria"], times["off"]))
    overhead = paired[len(paired) // 2] if len(paired) % 2 else (paired[len(paired) // 2 - 1] + paired[len(paired) // 2]) / 2
    print(f"time with / without: {per_step['egeria'] / per_step['off']:.3f} over all rounds; per round "
          f"{' '.join(f'{r:.3f}' for r in paired)} (median below: adjacent blocks share the machine's state)")
    if args.json:
        args.json.write_text(json.dumps({"ms_per_step": per_step, "rounds_s": times, "overhead": overhead,
                                         "round_ratios": paired,
                                         "reference": {k: v for k, v in vars(stats).items()}}, indent=2))
    print(f"figure: egeria_overhead = {overhead:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
