"""Knowledge distillation with the teacher's outputs served from the cache.

A fixed teacher is a frozen prefix that is a whole network (TSPipe, ICML '22). ``CachedTeacher`` is a
CachedForward frozen at depth 1 over two stages: the whole teacher (eval mode, ``no_grad``) returning
the tensors to store, then an identity. So the teacher gets what a frozen prefix gets: keys over its
weights and the data, the epoch's stream, fallback, audits, and loaders skipping the inputs it serves.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actcache.errors import ConfigError
from actcache_client.engine._audit import AuditConfig
from actcache_client.engine._batch import Batch
from actcache_client.engine._cached_forward import (
    CachedForward,
    ForwardLoaderSide,
    StepTimes,
)
from actcache_client.engine._codec_choice import AutoEncoding
from actcache_client.engine._frozen import prefix_fingerprints
from actcache_client.layouts._stages import Stage, StagedModel
from actcache_client.transport._connection import Connection
from actcache_client.transport._state import State
from actcache_client.transport._tensors import VarLen

__all__ = ["CachedTeacher", "MovingTeacherWarning", "TeacherOutput", "distillation_loss", "topk_soft_targets"]

LOGITS = "logits"


class MovingTeacherWarning(UserWarning):
    """The teacher's weights changed while it was in use (e.g. an EMA teacher): its outputs are not cached."""


@dataclass(frozen=True)
class TeacherOutput:
    """What the teacher gives for one batch, served or computed.

    Attributes:
        logits: The full logits (None with ``top_k``).
        top_values: The k largest logits, in descending order (None without ``top_k``).
        top_indices: Their class indices (None without ``top_k``).
        hidden: The chosen submodules' outputs by name.
        mask: The (B, L) attention mask of per-token outputs (else None).
    """

    logits: Tensor | None = None
    top_values: Tensor | None = None
    top_indices: Tensor | None = None
    hidden: dict[str, Tensor] = field(default_factory=dict)
    mask: Tensor | None = None

    def soft_targets(self, temperature: float = 1.0, num_classes: int | None = None) -> Tensor:
        """The distillation target ``softmax(logits / T)``; from top-k, renormalised over the k.

        Args:
            temperature: T.
            num_classes: The size of the full distribution (needed with top-k).

        Raises:
            ConfigError: No logits were kept, or top-k without ``num_classes``.
        """
        if self.logits is not None:
            return F.softmax(self.logits.float() / temperature, dim=-1)
        if self.top_values is None or self.top_indices is None:
            raise ConfigError("this teacher output has no logits: add 'logits' to CachedTeacher(outputs=...)")
        if num_classes is None:
            raise ConfigError("soft targets from top-k logits need num_classes (the size of the full distribution)")
        return topk_soft_targets(self.top_values, self.top_indices, num_classes, temperature)


def topk_soft_targets(values: Tensor, indices: Tensor, num_classes: int, temperature: float = 1.0) -> Tensor:
    """The soft target rebuilt from top-k logits: ``softmax(values / T)`` at ``indices``, zero elsewhere.

    Renormalised over the k classes (they sum to 1): the mass outside the top k is dropped.

    Args:
        values: The k largest logits.
        indices: Their class indices.
        num_classes: The size of the full distribution.
        temperature: T.

    Returns:
        The soft target, ``num_classes`` wide.

    Raises:
        ConfigError: ``temperature`` is not positive.
    """
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    probabilities = F.softmax(values.float() / temperature, dim=-1)
    out = torch.zeros((*values.shape[:-1], num_classes), dtype=probabilities.dtype, device=values.device)
    return out.scatter_(-1, indices.long(), probabilities)


def distillation_loss(student_logits: Tensor, teacher: TeacherOutput | Tensor, temperature: float = 1.0, *,
                      reduction: str = "mean") -> Tensor:
    """Hinton's KD loss: ``T² · KL(p || softmax(student / T))``, p the teacher's soft target.

    With top-k, p lives on the k classes (renormalised) and only the student's log-probabilities of
    those classes enter. The KL is summed over classes.

    Args:
        student_logits: The student's logits.
        teacher: A TeacherOutput (full or top-k logits) or a logits tensor.
        temperature: T.
        reduction: ``"mean"`` averages the KL over the other positions (samples, tokens), ``"none"``
            returns it per position.

    Returns:
        The loss.

    Raises:
        ConfigError: ``temperature`` is not positive, ``reduction`` is unknown, or the teacher output
            has no logits.
    """
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    if reduction not in ("mean", "none"):
        raise ConfigError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    if not isinstance(teacher, Tensor):
        logits, top_values, top_indices = teacher.logits, teacher.top_values, teacher.top_indices
    else:
        logits, top_values, top_indices = teacher, None, None
    if logits is not None:
        log_p = F.log_softmax(logits.float() / temperature, dim=-1)
    elif top_values is not None and top_indices is not None:
        log_p = F.log_softmax(top_values.float() / temperature, dim=-1)
        log_q = log_q.gather(-1, top_indices.long())
    else:
        raise ConfigError("this teacher output has no logits: add 'logits' to CachedTeacher(outputs=...)")
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1) * temperature**2
    return kl.mean() if reduction == "mean" else kl


@dataclass(frozen=True)
class _Part:
    """One stored tensor: which output it is, and whether it has a token axis (with VarLen)."""

    name: str
    kind: str  # "logits", "top_values", "top_indices" or "hidden"
    per_token: bool


class _TeacherStage(nn.Module):
    """Stage 0 of a CachedTeacher: the whole teacher, returning the tensors to store. Its ``spec`` buffer
    (the teacher's class, the output layout) puts what is stored into the weights fingerprint."""

    def __init__(self, teacher: nn.Module, outputs: Sequence[str], top_k: int | None, token_logits: bool,
                 varlen: VarLen | None) -> None:
        super().__init__()
        self.teacher = teacher
        self.varlen = varlen
        parts = []
        for name in outputs:
            if name == LOGITS:
                kinds = ["top_values", "top_indices"] if top_k else ["logits"]
                parts += [_Part(name, kind, varlen is not None and token_logits) for kind in kinds]
            else:
                try:
                    teacher.get_submodule(name)
                except AttributeError:
                    raise ConfigError(f"CachedTeacher output {name!r} is neither 'logits' nor a submodule of the "
                                      f"teacher ({type(teacher).__name__}); name one of its named_modules()") from None
                parts.append(_Part(name, "hidden", varlen is not None))
        # With VarLen: the mask first, then per-token tensors (the first one gives each sample's length), then
        # per-sample tensors with a token axis of 1 (stored whole).
        self.parts = sorted(parts, key=lambda p: not p.per_token) if varlen is not None else parts
        self.top_k = top_k
        spec = {"teacher": f"{type(teacher).__module__}.{type(teacher).__qualname__}", "top_k": top_k,
                "parts": [[p.name, p.kind, p.per_token] for p in self.parts],
                "mask_index": None if varlen is None else varlen.mask_index}
        self.register_buffer("spec", torch.tensor(list(json.dumps(spec).encode()), dtype=torch.uint8), persistent=False)

    @property
    def stores_mask(self) -> bool:
        return self.varlen is not None and any(p.per_token for p in self.parts)

    def forward(self, state: State) -> State:
        if self.teacher.training:  # the user's teacher.train() must not turn dropout back on
            self.teacher.eval()
        captured: dict[str, Tensor] = {}
        handles = [self.teacher.get_submodule(name).register_forward_hook(partial(_capture, captured, name))
                   for name in sorted({p.name for p in self.parts if p.kind == "hidden"})]
        try:
            spread = isinstance(state, tuple) and not isinstance(self.teacher, StagedModel)
            result = self.teacher(*state) if spread else self.teacher(state)
        finally:
            for handle in handles:
                handle.remove()
        values: dict[str, Tensor] = {}
        if any(p.name == LOGITS for p in self.parts):
            values["logits"] = _logits(result)
            if self.top_k:
                top = values["logits"].topk(self.top_k, dim=-1)
                values["top_values"], values["top_indices"] = top.values, top.indices.to(torch.int32)
        tensors = [captured[p.name] if p.kind == "hidden" else values[p.kind] for p in self.parts]
        varlen = self.varlen
        if not self.stores_mask or varlen is None:  # stores_mask: varlen is set
            return tuple(tensors)
        if not isinstance(state, tuple) or not -len(state) <= varlen.mask_index < len(state):
            raise ConfigError(f"CachedTeacher(varlen=...) needs the teacher's input as a tuple holding the attention "
                              f"mask at index {varlen.mask_index}")
        mask = state[varlen.mask_index]
        keep = mask.ne(0)
        out = [mask.to(varlen.mask_dtype)]
        for part, t in zip(self.parts, tensors):
            if not part.per_token:
                out.append(t.unsqueeze(1))
            elif t.dim() < 2 or t.shape[:2] != mask.shape:
                raise ConfigError(f"teacher output {part.name!r} has shape {tuple(t.shape)}; a per-token output "
                                  f"needs (batch, length, ...) = {tuple(mask.shape)}, ... like the mask")
            else:  # padded positions are zeros, as in served entries
                out.append(t * keep.view(*keep.shape, *[1] * (t.dim() - 2)).to(t.dtype))
        return tuple(out)

    def unpack(self, state: State) -> TeacherOutput:
        """The TeacherOutput of a stored (served or computed) state."""
        tensors = list(state) if isinstance(state, tuple) else [state]
        mask = tensors.pop(0) if self.stores_mask else None
        fields: dict[str, Any] = {"hidden": {}, "mask": mask}
        for part, t in zip(self.parts, tensors):
            if mask is not None and not part.per_token:
                t = t[:, 0]
            if part.kind == "hidden":
                fields["hidden"][part.name] = t
            else:
                fields[part.kind] = t.long() if part.kind == "top_indices" else t
        return TeacherOutput(**fields)


def _capture(into: dict[str, Tensor], name: str, module: nn.Module, args: Any, output: Any) -> None:
    into[name] = output[0] if isinstance(output, (tuple, list)) else output


def _logits(result: Any) -> Tensor:
    if isinstance(result, Tensor):
        return result
    if isinstance(getattr(result, "logits", None), Tensor):
        return result.logits
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], Tensor):
        return result[0]
    raise ConfigError(f"the teacher returned a {type(result).__name__}; 'logits' needs a tensor, an object with "
                      "a .logits tensor, or a tuple whose first element is the logits")


class CachedTeacher:
    """A frozen teacher whose outputs are served from the cache: ``out = teacher(batch)``.

    Call it with a CachedLoader Batch, ``cached_teacher(batch)``, or with every row's inputs,
    ``cached_teacher(ids, inputs, variant=v)``; it returns a TeacherOutput. The teacher is called as
    ``teacher(*inputs)`` for a tuple of inputs (``teacher(inputs)`` for a tensor or a StagedModel),
    in eval mode under ``no_grad``, its parameters with ``requires_grad=False``. Feed it and its student from one loader,
    ``CachedLoader(loader, model=[student, cached_teacher])``; a plain-module student reading
    ``batch.data`` needs every input: wrap it in a CachedForward (nothing frozen) and list it, or give
    the dataset no ``targets`` (then no input is ever skipped).

    Stored per sample, keyed by the teacher's weights, this layout and the data: ``"logits"`` in
    ``outputs`` is the teacher's return value, or with ``top_k=k`` its k largest logits and their class
    indices; every other name in ``outputs`` is a submodule whose output is kept. With
    ``varlen=VarLen()`` submodule outputs (and logits with ``token_logits=True``) are per token, stored
    without their padding; padded positions are zeros. A moving teacher is not cacheable: at every epoch
    start and at ``check_weights()`` its weights are compared with its keys' (see there).
    ``cached_forward`` is the CachedForward doing the work.

    Args:
        teacher: The frozen teacher.
        connection: The daemon's connection (CachedForward's).
        outputs: ``"logits"`` (the teacher's return value) and/or names of submodules whose output is kept.
        top_k: Keep only the k largest logits and their class indices.
        token_logits: The logits are per token (needs ``varlen``).
        varlen: Submodule outputs (and logits with ``token_logits``) are per token, stored without their
            padding; padded positions are zeros.
        encoding: How the daemon stores the entries (as CachedForward's).
        stream: False reads entries with ``Get`` instead of the daemon's stream.
        device: The device inputs and served entries are moved to (as CachedForward's).
        audit: Recompute a share of hits to check the cache (as CachedForward's).
        keep_generations: Keep the entries of superseded fingerprints in the daemon.
        store_dtype: torch.float16 or torch.bfloat16 stores floating-point outputs in 16 bits.

    Raises:
        ConfigError: ``outputs`` is empty or repeats a name, ``top_k`` is below 1 or without ``"logits"``,
            or ``token_logits`` without ``varlen``.
    """

    def __init__(
        self,
        teacher: nn.Module,
        connection: Connection | None = None,
        *,
        outputs: Sequence[str] = (LOGITS,),
        top_k: int | None = None,
        token_logits: bool = False,
        varlen: VarLen | None = None,
        encoding: str | AutoEncoding = "auto",
        stream: bool = True,
        device: torch.device | str | None = None,
        audit: AuditConfig | bool = True,
        keep_generations: bool = False,
        store_dtype: torch.dtype | None = None,
    ) -> None:
        outputs = [outputs] if isinstance(outputs, str) else list(outputs)
        if not outputs or len(set(outputs)) != len(outputs):
            raise ConfigError(f"CachedTeacher needs distinct outputs ('logits' and/or submodule names), got {outputs}")
        if top_k is not None and (top_k < 1 or LOGITS not in outputs):
            raise ConfigError(f"top_k must be >= 1 and needs 'logits' in outputs, got top_k={top_k}, outputs={outputs}")
        if token_logits and varlen is None:
            raise ConfigError("token_logits=True describes per-token logits of text: it needs varlen=VarLen()")
        self.teacher = teacher
        self.stage = _TeacherStage(teacher, outputs, top_k, token_logits, varlen)
        self.staged = StagedModel([Stage("teacher", self.stage), Stage("output", nn.Identity())])
        self.cached_forward = CachedForward(
            self.staged, connection, varlen=VarLen(0, varlen.mask_dtype) if self.stage.stores_mask and varlen else None,
            encoding=encoding, stream=stream, device=device, audit=audit, keep_generations=keep_generations,
            store_dtype=store_dtype,
        )
        self.cached_forward.set_frozen(1)
        #: CachedLoader's calls (a LoaderSide); each epoch start checks the weights first.
        self.loader_side = ForwardLoaderSide(self.cached_forward, before_epoch=self.check_weights)
        self.moved = False  # the weights changed while in use: not cached any more
        self._used = False  # called since the weights were last fingerprinted

    @property
    def connection(self) -> Connection | None:
        return self.cached_forward.connection

    @property
    def times(self) -> StepTimes:
        return self.cached_forward.times

    @property
    def enabled(self) -> bool:
        return self.cached_forward.enabled

    @property
    def disabled_reason(self) -> str:
        return self.cached_forward.disabled_reason

    def fingerprint(self) -> bytes:
        """The fingerprint the teacher's cache keys carry: its weights, outputs, and the data."""
        return self.cached_forward.fingerprint(1)

    def weights_fingerprint(self) -> bytes:
        """The fingerprint of the teacher's weights (and output layout) its keys were made with."""
        return self.cached_forward.weights_fingerprint(1)

    def check_weights(self) -> bool:
        """Compare the teacher's weights with its keys' fingerprint; False once it is known to move.

        A change before the teacher was used re-keys it; a change after it was used disables the cache
        (MovingTeacherWarning, once) and drops what it stored under the old fingerprint (unless
        ``keep_generations``).
        """
        if self.moved:
            return False
        current = prefix_fingerprints(list(self.staged.stages), 1)[1]
        if current == self.weights_fingerprint():
            return True
        if not self._used:
            self.cached_forward.set_frozen(1)
            return True
        old = self.fingerprint()
        self.moved = True
        self.loader_side.disable("the teacher's weights changed while it was in use (a moving teacher)")
        if self.connection is not None and not self.cached_forward.keep_generations:
            self.connection.drop(old)
        warnings.warn(
            f"actcache: the teacher's weights changed while it was in use (its key's fingerprint {old.hex()[:12]} "
            "no longer matches them): a moving teacher (e.g. an EMA of the student) is not cacheable; its outputs "
            "are recomputed every step from now on and what it stored under that fingerprint is dropped. "
            "CachedTeacher pays off only for a fixed teacher.",
            MovingTeacherWarning, stacklevel=2)
        return False

    def __call__(self, batch: Batch | Tensor | Sequence[int], inputs: State | None = None, *,
                 variant: int = 0) -> TeacherOutput:
        """The teacher's outputs for a batch: served from the cache, or computed (no grad, eval) and stored.

        Args:
            batch: A CachedLoader Batch, or the batch's sample ids (with ``inputs``).
            inputs: Every row's input, with sample ids.
            variant: The augmented version of the samples, with sample ids.
        """
        self._used = True
        return self.stage.unpack(self.cached_forward(batch, inputs, variant=variant))
