"""actcache_client: serve a network's frozen prefix from the actcache daemon.

In a plain loop (the loop and its batches stay as they are):

    cache = actcache_client.ActCache(net)                # this node's daemon, started on first use
    loader = cache.wrap(DataLoader(ds, batch_size=64, shuffle=True))
    for x, y in loader:
        loss = F.cross_entropy(net(x), y)                # net's frozen prefix is served from the cache
    cache.freeze(4)                                      # or FreezeController(cache.model, opt)

Underneath, with the batch type of its own:

    conn = actcache_client.connect()                      # this node's daemon, started on first use
    model = actcache_client.CachedForward(from_resnet(net), conn)
    data = actcache_client.IndexedDataset(ds, targets=ds.targets)  # the cache serves what is not loaded
    loader = actcache_client.CachedLoader(DataLoader(data, batch_size=64, shuffle=True), model)
    ctl = actcache_client.FreezeController(model, opt, actcache_client.EgeriaPolicy(), eval_every=100)
    for batch in loader:
        x, y = batch.data
        loss = F.cross_entropy(model(batch), y)
        opt.zero_grad(); loss.backward(); opt.step()
        ctl.step(loss, epoch=batch.epoch)             # freezes stages when the policy says so

Errors are actcache's (``actcache.ActCacheError`` and its subclasses).

The user API lives here, on rooms that each import only the ones before it: ``transport`` (the daemon's
connection, the epoch stream, tensors to and from entries), ``layouts`` (a network split into stages),
``engine`` (the cached forward), ``data`` (the cached loader), ``freeze`` (when to freeze); ``integrations``
sits above the API. ``cost_model`` is the arithmetic below them all.
"""

from actcache_client._dropin import ActCache, StageInfo, WrappedLoader
from actcache_client._inplace import ChangedInputWarning
from actcache_client._options import CacheOptions
from actcache_client.data._loader import Batch, CachedLoader, IndexedDataset, UncacheableDataWarning
from actcache_client.engine._audit import AuditConfig, CacheMismatchWarning
from actcache_client.engine._cached_forward import CachedForward, EpochCounters, StepTimes
from actcache_client.engine._codec_choice import AutoEncoding
from actcache_client.engine._planner import CachePlanner, PlannerConfig
from actcache_client.engine._teacher import (
    CachedTeacher,
    MovingTeacherWarning,
    TeacherOutput,
    distillation_loss,
    topk_soft_targets,
)
from actcache_client.freeze import (
    AutoFreezeConfig,
    AutoFreezePolicy,
    Decision,
    DecisionKind,
    EgeriaConfig,
    EgeriaPolicy,
    FreezeController,
    FreezeMilestone,
    FreezePolicy,
    ManualPolicy,
    ReferenceConfig,
    Signals,
    StaticPolicy,
)
from actcache_client.layouts import Layout, register_layout
from actcache_client.layouts._stages import Stage, StagedModel, auto_partition, from_bert, from_resnet, from_sequential
from actcache_client.sampler import NodeStableSampler
from actcache_client.transport._connection import CacheFallbackWarning, ClientStats, Connection, ConnectionConfig
from actcache_client.transport._node_daemon import connect
from actcache_client.transport._tensors import VarLen

__all__ = [
    "ActCache",
    "AuditConfig",
    "AutoEncoding",
    "AutoFreezeConfig",
    "AutoFreezePolicy",
    "Batch",
    "CacheFallbackWarning",
    "CacheMismatchWarning",
    "CacheOptions",
    "CachePlanner",
    "CachedForward",
    "CachedLoader",
    "CachedTeacher",
    "ChangedInputWarning",
    "ClientStats",
    "Connection",
    "ConnectionConfig",
    "Decision",
    "DecisionKind",
    "EgeriaConfig",
    "EgeriaPolicy",
    "EpochCounters",
    "FreezeController",
    "FreezeMilestone",
    "FreezePolicy",
    "IndexedDataset",
    "Layout",
    "ManualPolicy",
    "MovingTeacherWarning",
    "NodeStableSampler",
    "PlannerConfig",
    "ReferenceConfig",
    "Signals",
    "Stage",
    "StageInfo",
    "StagedModel",
    "StaticPolicy",
    "StepTimes",
    "TeacherOutput",
    "UncacheableDataWarning",
    "VarLen",
    "WrappedLoader",
    "auto_partition",
    "connect",
    "distillation_loss",
    "from_bert",
    "from_resnet",
    "from_sequential",
    "register_layout",
    "topk_soft_targets",
]
