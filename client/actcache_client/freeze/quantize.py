"""The reference copy of one stage at a chosen precision, with its measured speed.

Egeria (§4.1.3, §5) quantizes a snapshot of the training model to int8 on the
CPU: dynamic quantization for Linear-heavy (NLP) models, static quantization
for convolutional ones, full precision when int8 does not work. Precisions:

    dynamic_int8  torch.ao.quantization.quantize_dynamic on nn.Linear (weights int8,
                  activations quantized on the fly)
    static_int8   FX graph mode: prepare_fx with the backend's default qconfig,
                  calibrated on one batch, convert_fx
    fp32, bf16    the stage as is, or cast to bfloat16 (outputs back to float32)
    auto          dynamic_int8 for stages with more Linear than conv parameters,
                  static_int8 otherwise; the int8 build is kept if it works and is
                  not slower than fp32, else the faster of fp32 and bf16

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
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from actcache_client.freeze.plasticity import sp_loss
from actcache_client.stages import State

__all__ = ["BuiltReference", "PRECISIONS", "build_reference", "linear_heavy"]

PRECISIONS = ("auto", "dynamic_int8", "static_int8", "fp32", "bf16")
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


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


def linear_heavy(module: nn.Module) -> bool:
    """More parameters in nn.Linear layers than in convolutions."""
    linear = sum(p.numel() for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters(False))
    conv = sum(p.numel() for m in module.modules() if isinstance(m, _CONV) for p in m.parameters(False))
    return linear > conv


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
    raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")


def _time(fn: Callable[[State], State], example: State) -> float:
    start = time.perf_counter()
    fn(example)
    return 1e3 * (time.perf_counter() - start)


def build_reference(module: nn.Module, precision: str, example: State, *, repeats: int = 3) -> BuiltReference:
    """Build the reference of ``module`` (a CPU copy, switched to eval mode) and measure it on ``example``.

    With ``precision="auto"`` every candidate is built and timed, interleaved,
    ``repeats`` times; a candidate that fails to build or gives non-finite
    outputs is skipped with a note. A fixed precision that fails raises.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    module = module.eval()
    if precision == "auto":
        first = "dynamic_int8" if linear_heavy(module) else "static_int8"
        candidates = [first, "fp32"] + ([] if first == "dynamic_int8" else ["bf16"])
    else:
        candidates = [precision]
    built: dict[str, Callable[[State], State]] = {}
    error: dict[str, float] = {}
    notes: list[str] = []
    with torch.no_grad():
        baseline = _floats(module(example))
        for name in candidates:
            try:
                fn = _build(module, name, example)
                error[name] = sp_loss(_floats(fn(example)), baseline)
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
            raise RuntimeError(f"no reference precision works for this stage: {'; '.join(notes)}")
        times = {name: math.inf for name in built}
        for _ in range(repeats):
            for name, fn in built.items():
                times[name] = min(times[name], _time(fn, example))
    chosen = candidates[0] if candidates[0] in built else min(built, key=times.__getitem__)
    if precision == "auto" and chosen.endswith("int8") and "fp32" in times and times[chosen] > times["fp32"]:
        notes.append(f"{chosen} ({times[chosen]:.2f} ms) is slower than fp32 ({times['fp32']:.2f} ms)")
        chosen = min((n for n in built if not n.endswith("int8")), key=times.__getitem__)
    return BuiltReference(built[chosen], chosen, times, error, notes)
