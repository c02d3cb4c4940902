"""When to freeze: pluggable policies that turn training signals into freeze decisions.

``FreezeController`` applies a policy's decisions: ``EgeriaPolicy`` (plasticity
against a reference model), ``AutoFreezePolicy`` (gradient-norm change),
``StaticPolicy`` (a schedule), ``ManualPolicy`` (requests), ``NoFreezePolicy``
(never); each passes ``check_freeze_policy_contract``. Without a policy the
controller takes ``default_policy`` for the run's length.
"""

from actcache_client.freeze.autofreeze import AutoFreezeConfig, AutoFreezePolicy
from actcache_client.freeze.controller import FreezeController
from actcache_client.freeze.defaults import default_policy
from actcache_client.freeze.egeria import EgeriaConfig, EgeriaPolicy
from actcache_client.freeze.plasticity import sp_loss
from actcache_client.freeze.policy import (
    SIGNAL_NAMES,
    Decision,
    DecisionKind,
    FreezePolicy,
    Signals,
    check_freeze_policy_contract,
)
from actcache_client.freeze.reference import ReferenceConfig, ReferenceState, ReferenceStats, ReferenceWorker
from actcache_client.freeze.static import FreezeMilestone, ManualPolicy, NoFreezePolicy, StaticPolicy
from actcache_client.freeze.timeline import Timeline, read_timeline

__all__ = [
    "AutoFreezeConfig",
    "AutoFreezePolicy",
    "Decision",
    "DecisionKind",
    "EgeriaConfig",
    "EgeriaPolicy",
    "FreezeController",
    "FreezeMilestone",
    "FreezePolicy",
    "ManualPolicy",
    "NoFreezePolicy",
    "ReferenceConfig",
    "ReferenceState",
    "ReferenceStats",
    "ReferenceWorker",
    "SIGNAL_NAMES",
    "Signals",
    "StaticPolicy",
    "Timeline",
    "check_freeze_policy_contract",
    "default_policy",
    "read_timeline",
    "sp_loss",
]
