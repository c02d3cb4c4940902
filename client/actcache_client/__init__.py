"""actcache_client: serve a network's frozen prefix from the actcache daemon.

    conn = actcache_client.connect()                      # embedded daemon if none is running
    model = actcache_client.CachedForward(from_resnet(net), conn)
    loader = actcache_client.CachedLoader(DataLoader(IndexedDataset(ds), batch_size=64, shuffle=True), model)
    model.set_frozen(4)
    for batch in loader:
        x, y = batch.data
        loss = F.cross_entropy(model(batch.ids, x, variant=batch.variant), y)
"""

from actcache_client.cached_forward import CachedForward, StepTimes
from actcache_client.connection import CacheFallbackWarning, ClientStats, Connection, ConnectionConfig, connect
from actcache_client.loader import Batch, CachedLoader, IndexedDataset, UncacheableDataWarning
from actcache_client.planner import CachePlanner, PlannerConfig
from actcache_client.stages import StagedModel, auto_partition, from_bert, from_resnet, from_sequential
from actcache_client.tensors import VarLen

__all__ = [
    "Batch",
    "CacheFallbackWarning",
    "CachePlanner",
    "CachedForward",
    "CachedLoader",
    "ClientStats",
    "Connection",
    "ConnectionConfig",
    "IndexedDataset",
    "PlannerConfig",
    "StagedModel",
    "StepTimes",
    "UncacheableDataWarning",
    "VarLen",
    "auto_partition",
    "connect",
    "from_bert",
    "from_resnet",
    "from_sequential",
]
