"""``CacheOptions``: what ``ActCache`` (and the integrations) pass to the CachedForward that serves the prefix."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Union

import torch

from actcache.errors import ConfigError
from actcache_client.engine._audit import AuditConfig
from actcache_client.engine._codec_choice import AutoEncoding
from actcache_client.engine._planner import CachePlanner
from actcache_client.engine._writer import check_encoding
from actcache_client.transport._tensors import VarLen

__all__ = ["AUTO_PLANNER", "LAYOUT_VARLEN", "CacheOptions"]

LAYOUT_VARLEN = "layout"  # CacheOptions.varlen's default: what the network's layout says
AUTO_PLANNER = "auto"  # CacheOptions.planner's default: a CachePlanner of its own for each ActCache


@dataclass(frozen=True, kw_only=True)
class CacheOptions:
    """How the frozen prefix is stored and served.

    Args:
        store_dtype: torch.float16 or torch.bfloat16 stores floating-point outputs in 16 bits (served rounded);
            None stores them as computed.
        encoding: ``"auto"`` (an AutoEncoding), ``"daemon"``, ``"raw"``, ``"lz4"``, ``"zstd"`` or ``"zstd:LEVEL"``.
        audit: an AuditConfig, True (its defaults) or False: recompute a share of hits to catch what no key sees.
        planner: ``"auto"`` (a CachePlanner with its defaults, one per ActCache) or a CachePlanner: the cost
            model decides whether serving the prefix beats recomputing it; None always serves the frozen depth.
        stream: False reads entries with ``Get`` instead of the daemon's stream of the pushed order.
        keep_generations: True keeps the entries of superseded fingerprints in the daemon.
        varlen: how padded text is stored: a VarLen (each sample at its own length, right padding), None (every
            sample at the batch's shape: fixed-length padding), or ``"layout"``: what the network's layout says.
        device: where served entries go (default: the network's parameters' device).
        check: compare the stages found with the network's own forward on the first batch (a ConfigError
            names the stage where they part).
    """

    store_dtype: torch.dtype | None = None
    encoding: Union[str, AutoEncoding] = "auto"
    audit: Union[AuditConfig, bool] = True
    planner: Union[CachePlanner, None, str] = AUTO_PLANNER
    stream: bool = True
    keep_generations: bool = False
    varlen: Union[VarLen, None, str] = LAYOUT_VARLEN
    device: Union[torch.device, str, None] = None
    check: bool = True

    def __post_init__(self) -> None:
        if self.store_dtype not in (None, torch.float16, torch.bfloat16):
            raise ConfigError(f"store_dtype must be torch.float16, torch.bfloat16 or None, got {self.store_dtype!r}")
        check_encoding(self.encoding)
        if not isinstance(self.audit, (AuditConfig, bool)):
            raise ConfigError(f"audit is an AuditConfig or a bool, got {type(self.audit).__name__}")
        if not (self.planner is None or isinstance(self.planner, CachePlanner) or self.planner == AUTO_PLANNER):
            raise ConfigError(f"planner is a CachePlanner, None or {AUTO_PLANNER!r}, got {self.planner!r}")
        for name in ("stream", "keep_generations", "check"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} is a bool, got {getattr(self, name)!r}")
        if not (self.varlen is None or isinstance(self.varlen, VarLen) or self.varlen == LAYOUT_VARLEN):
            raise ConfigError(f"varlen is a VarLen, None or {LAYOUT_VARLEN!r}, got {self.varlen!r}")

    @classmethod
    def of(cls, options: CacheOptions | None = None, **given: Any) -> CacheOptions:
        """``options`` with the keywords ``given`` replacing its fields.

        Args:
            options: The options to start from; default: ``CacheOptions()``.
            **given: Fields to replace.

        Raises:
            ConfigError: An unknown keyword (the message names the valid ones), or ``options`` is not a
                CacheOptions.
        """
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(given) - set(valid))
        if unknown:
            raise ConfigError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the options "
                              f"are {', '.join(valid)} (see CacheOptions)")
        if options is not None and not isinstance(options, CacheOptions):
            raise ConfigError(f"options= is a CacheOptions, got {type(options).__name__}")
        base = {f.name: getattr(options, f.name) for f in fields(cls)} if options is not None else {}
        return cls(**{**base, **given})

    def forward_options(self, layout_varlen: VarLen | None) -> dict[str, Any]:
        """CachedForward's keyword arguments: the layout's VarLen where ``varlen`` is ``"layout"``, a new
        CachePlanner where ``planner`` is ``"auto"``.

        Args:
            layout_varlen: The layout's VarLen.
        """
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "check"}
        if self.varlen == LAYOUT_VARLEN:
            out["varlen"] = layout_varlen
        if self.planner == AUTO_PLANNER:
            out["planner"] = CachePlanner()
        return out


