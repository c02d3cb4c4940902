"""The reference copy of one stage at a chosen precision, with its measured speed.

Egeria (§4.1.3, §5) quantizes a snapshot of the training model to int8 on the
CPU: dynamic quantization for Linear-heavy (NLP) models, static quantization
for convolutional ones, full precision when int8 does not work. Precisions:

    dynamic_int8  torch.ao.quantization.quantize_dynamic on nn.Linear (weights int8,
                  activations quantized on the fly)
    static_int8   FX graph mode: prepare_fx with the backend's default qconfig,
                  calibrated on one batch, convert_fx
    fp32, bf16    the stage as is, or cast to bfloat16 (outputs back to float32)
    auto          fp32 for a stage with neither Linear nor conv layers (an embedding
                  lookup, a norm: nothing to quantize); otherwise dynamic_int8 for
                  stages with more Linear than conv parameters, static_int8 for the
                  others, and bf16 beside it for conv stages. A candidate must first
                  resolve a small drift (below); then fp32 is kept unless a
                  candidate is cheaper by AUTO_MARGIN (10%) in every one of the
                  interleaved timing rounds; of those that are, the cheapest (median
                  over the rounds) wins. A one-off timing win by noise never decides.
                  The cost of a candidate is what one plasticity reading costs: the
                  reference of a new snapshot is built (one per evaluation,
                  reference.py) and two are run, so build + 2 runs. Static int8 runs
                  a ResNet-20 module 5x faster than fp32 but its FX build takes
                  ~200 ms (measured: stem..layer2.0, batch 64, 1 thread: build 190
                  ms, run 7 ms; fp32 run 50 ms; bf16 build 3 ms, run 17-24 ms).

Resolution. Egeria profiles its reference "to make sure the CPU-efficient
reference model can provide accurate plasticity evaluation" (§1). A reading
compares two snapshots of a stage, and a freeze is decided on readings of
a fifth of a stage's early drift and less, so a reference must read small
weight changes as fp32 does. Quantized ones read them as rounding: int8
keeps one scale per weight tensor (or channel), so when its largest weight
moves every weight rounds again, and bf16 rounds each weight and
activation anew. Measured, SP loss between references of a stage and of
the stage with every weight tensor moved by eps x its mean magnitude
(fp32 / int8 / bf16; MiniLM's encoder layer 0 on 32 CoLA sentences with
dynamic int8; ResNet-20's stem..layer2.0 on 64 digits with static int8
calibrated on the same batch)::

    eps     MiniLM layer 0                    ResNet-20 stage 0
    1e-6    2.6e-16 / 9.9e-9 / 2.0e-10        7.7e-16 / 3.3e-8 / 1.2e-10
    1e-4    2.3e-12 / 1.6e-7 / 6.4e-10        2.9e-11 / 5.5e-8 / 2.2e-9
    1e-2    1.2e-8  / 4.9e-7 / 7.0e-8         6.0e-8  / 2.7e-7 / 1.3e-7

On CoLA, layer 0's int8 readings stayed at 1e-7 to 5e-7 while the LR
decayed to 0, above the T they were compared with (bench/README.md). So
under ``auto`` a candidate is kept only if it reads a drift of
RESOLUTION_DRIFT (every weight tensor moved by 1e-3 x its mean magnitude)
within RESOLUTION_FACTOR (2x) of fp32's reading; on the stages above
neither int8 nor bf16 is. Explicit precisions are used as asked.

Why torch.ao and not torchao: in torch 2.13 eager and FX quantization warn
that they are deprecated in favour of torchao. torchao 0.18 installs on this
CPU build, but its int8 configs ran slower than fp32 here (Linear 512x512,
batch 64, 1 thread: fp32 2.1 ms, torchao int8 dynamic 7.2 ms, weight-only
5.2 ms, torch.ao quantize_dynamic 1.3 ms), and importing it prints errors
about its CUDA extensions. So this module uses torch.ao and silences exactly
its deprecation notices (``_quiet_ao``).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from actcache.errors import ConfigError, ReferenceModelFailed
from actcache_client.freeze.plasticity import sp_loss
from actcache_client._stages import State

__all__ = ["AUTO_MARGIN", "BuiltReference", "PRECISIONS", "RESOLUTION_DRIFT", "RESOLUTION_FACTOR", "build_reference",
           "linear_heavy", "quantizable"]

PRECISIONS = ("auto", "dynamic_int8", "static_int8", "fp32", "bf16")
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: Under ``auto`` a candidate replaces fp32 only if it is this much faster in every timing round.
AUTO_MARGIN = 0.10
#: Under ``auto`` a candidate must read a drift of this size (each weight tensor moved by this times
#: its mean magnitude) within RESOLUTION_FACTOR of fp32's reading (module docstring).
RESOLUTION_DRIFT = 1e-3
RESOLUTION_FACTOR = 2.0


@dataclass(frozen=True)
class BuiltReference:
    """A stage's reference: ``run(state)`` gives float outputs; how it was chosen, in numbers."""

    run: Callable[[State], State]
    precision: str
    #: Milliseconds per call on the calibration batch, per precision tried (best of the repeats).
    ms_per_batch: dict[str, float]
    #: SP loss between each tried precision's output and fp32's on the calibration batch.
    error_vs_fp32: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Milliseconds to build each precision tried from the stage (best of the repeats).
    ms_per_build: dict[str, float] = field(default_factory=dict)
    #: Under ``auto``: SP loss each tried precision reads for a drift of RESOLUTION_DRIFT.
    drift_reading: dict[str, float] = field(default_factory=dict)


@contextmanager
def _quiet_ao() -> Iterator[None]:
    # torch 2.13 deprecates torch.ao.quantization in favour of torchao, which runs slower here
    # (module docstring); silence exactly those notices, nothing else.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"torch\.ao\.quantization is deprecated", DeprecationWarning)
        warnings.filterwarnings("ignore", r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other "
                                          r"quantized tensor creation functions", UserWarning)
        warnings.filterwarnings("ignore", r"Please use quant_min and quant_max to specify the range for "
                                          r"observers", UserWarning)
        yield


def _map(state: State, fn: Callable[[torch.Tensor], torch.Tensor]) -> State:
    return tuple(fn(t) for t in state) if isinstance(state, tuple) else fn(state)


def _floats(state: State) -> State:
    return _map(state, lambda t: t.float() if t.is_floating_point() else t)


def _counts(module: nn.Module) -> tuple[int, int]:
    linear = sum(p.numel() for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters(False))
    conv = sum(p.numel() for m in module.modules() if isinstance(m, _CONV) for p in m.parameters(False))
    return linear, conv


def linear_heavy(module: nn.Module) -> bool:
    """More parameters in nn.Linear layers than in convolutions."""
    linear, conv = _counts(module)
    return linear > conv


def quantizable(module: nn.Module) -> bool:
    """Has nn.Linear or convolution layers with parameters: something int8 can speed up."""
    return sum(_counts(module)) > 0


def _build(module: nn.Module, precision: str, example: State) -> Callable[[State], State]:
    if precision == "fp32":
        return module
    if precision == "bf16":
        half = copy.deepcopy(module).to(torch.bfloat16)
        cast = lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t  # noqa: E731
        return lambda state: _floats(half(_map(state, cast)))
    if precision == "dynamic_int8":
        with _quiet_ao():
            return torch.ao.quantization.quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8)
    if precision == "static_int8":
        from torch.ao.quantization import get_default_qconfig_mapping
        from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

        with _quiet_ao():
            mapping = get_default_qconfig_mapping(torch.backends.quantized.engine)
            prepared = prepare_fx(copy.deepcopy(module), mapping, (example,))
            prepared(example)  # calibration: observers record the ranges of this batch
            return convert_fx(prepared)
    raise ConfigError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")


def _drifted(module: nn.Module, drift: float) -> nn.Module:
    """A copy of ``module`` with every floating parameter moved by ``drift`` x its mean magnitude (seeded)."""
    moved = copy.deepcopy(module)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moved.parameters():
            if p.is_floating_point() and p.numel():
                p.add_(drift * p.abs().mean() * torch.randn(p.shape, generator=g).to(p.dtype))
    return moved


def _time(fn: Callable[[State], State], example: State) -> float:
    start = time.perf_counter()
    fn(example)
    return 1e3 * (time.perf_counter() - start)


def _build_ms(module: nn.Module, precision: str, example: State) -> float:
    start = time.perf_counter()
    _build(module, precision, example)
    return 1e3 * (time.perf_counter() - start)


def build_reference(module: nn.Module, precision: str, example: State, *, repeats: int = 5) -> BuiltReference:
    """Build the reference of ``module`` (a CPU copy, switched to eval mode) and measure it on ``example``.

    With ``precision="auto"`` every candidate is built and timed, interleaved,
    ``repeats`` times (see the module docstring for the choice); a candidate
    that fails to build or gives non-finite outputs is skipped with a note. A
    fixed precision that fails raises. ``repeats=0`` with a fixed precision
    only builds it (no timing, no error measured): a refreshed snapshot of a
    stage whose precision was chosen before.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if repeats < 0 or (repeats == 0 and precision == "auto"):
        raise ConfigError(f"repeats={repeats}: auto needs timings (repeats >= 1); a fixed precision takes >= 0")
    module = module.eval()
    notes: list[str] = []
    if precision == "auto" and not quantizable(module):
        notes.append("no Linear or convolution layers to quantize: full precision")
        candidates = ["fp32"]
    elif precision == "auto":
        first = "dynamic_int8" if linear_heavy(module) else "static_int8"
        candidates = ["fp32", first] + ([] if first == "dynamic_int8" else ["bf16"])
    else:
        candidates = [precision]
    if repeats == 0:
        with torch.no_grad():
            return BuiltReference(_build(module, precision, example), precision, {}, {}, notes)
    built: dict[str, Callable[[State], State]] = {}
    error: dict[str, float] = {}
    outputs: dict[str, State] = {}  # each candidate's output on the example, for the drift check too
    with torch.no_grad():
        baseline = _floats(module(example))
        for name in candidates:
            try:
                fn = _build(module, name, example)
                outputs[name] = _floats(fn(example))
                error[name] = sp_loss(outputs[name], baseline)
            except Exception as exc:  # an unsupported op, an untraceable forward, ...
                if precision != "auto":
                    raise
                notes.append(f"{name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                continue
            if not math.isfinite(error[name]):
                notes.append(f"{name} gives non-finite outputs")
                del error[name]
                continue
            built[name] = fn
        if not built:
            raise ReferenceModelFailed(f"no reference precision works for this stage: {'; '.join(notes)}")
        compared = precision == "auto" and "fp32" in built and len(built) > 1
        drift = _resolve(module, built, outputs, example, notes) if compared else {}
        runs: dict[str, list[float]] = {name: [] for name in built}
        builds: dict[str, list[float]] = {name: [] for name in built}
        for _ in range(repeats):
            for name, fn in built.items():
                runs[name].append(_time(fn, example))
                if precision == "auto":
                    builds[name].append(_build_ms(module, name, example))
    times = {name: min(t) for name, t in runs.items()}
    if precision != "auto":
        return BuiltReference(built[precision], precision, times, error, notes)
    rounds = {name: [b + 2 * r for b, r in zip(builds[name], runs[name], strict=True)] for name in built}
    build_ms = {name: min(t) for name, t in builds.items()}
    return BuiltReference(*_choose(built, rounds, notes), times, error, notes, build_ms, drift)


def _resolve(module: nn.Module, built: dict[str, Callable[[State], State]], outputs: dict[str, State],
             example: State, notes: list[str]) -> dict[str, float]:
    """Each built precision's reading of a RESOLUTION_DRIFT drift (its ``outputs`` on the example against
    a moved copy's); drops from ``built`` the candidates that read it beyond RESOLUTION_FACTOR of fp32's
    (module docstring)."""
    moved = _drifted(module, RESOLUTION_DRIFT)
    readings = {name: sp_loss(outputs[name], _floats(_build(moved, name, example)(example))) for name in built}
    exact = readings["fp32"]
    for name in [n for n in built if n != "fp32"]:
        if not exact / RESOLUTION_FACTOR <= readings[name] <= exact * RESOLUTION_FACTOR:
            notes.append(f"{name} reads a {RESOLUTION_DRIFT:g} drift as {readings[name]:.2g} against fp32's "
                         f"{exact:.2g}: it cannot resolve the drifts the freeze test compares")
            del built[name]
    return readings


def _choose(built: dict[str, Callable[[State], State]], rounds: dict[str, list[float]],
            notes: list[str]) -> tuple[Callable[[State], State], str]:
    """fp32 unless a candidate is AUTO_MARGIN cheaper (build + 2 runs) in every round; then the cheapest by median."""
    if "fp32" not in built:  # fp32 is the stage itself: it fails only if the stage does
        name = min(built, key=lambda n: statistics.median(rounds[n]))
        return built[name], name
    winners = {}
    for name, times in rounds.items():
        if name == "fp32":
            continue
        ratios = [t / f for t, f in zip(times, rounds["fp32"], strict=True)]
        if max(ratios) <= 1 - AUTO_MARGIN:
            winners[name] = statistics.median(ratios)
        else:
            notes.append(f"{name} not cheaper than fp32 by {AUTO_MARGIN:.0%} in every round "
                         f"(build + 2 runs, ratios {', '.join(f'{r:.2f}' for r in ratios)})")
    if not winners:
        return built["fp32"], "fp32"
    name = min(winners, key=winners.__getitem__)
    return built[name], name
