"""When to freeze: pluggable policies that turn training signals into freeze decisions.

The controller (not here) applies the decisions to the model. Policies:
``EgeriaPolicy`` (plasticity: SP loss against a reference model),
``AutoFreezePolicy`` (gradient-norm change), ``StaticPolicy`` (a schedule) and
``ManualPolicy`` (requests). Every one passes ``check_freeze_policy_contract``.
"""

from actcache_client.freeze.autofreeze import AutoFreezeConfig, AutoFreezePolicy
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
from actcache_client.freeze.static import FreezeMilestone, ManualPolicy, StaticPolicy

__all__ = [
    "AutoFreezeConfig",
    "AutoFreezePolicy",
    "Decision",
    "DecisionKind",
    "EgeriaConfig",
    "EgeriaPolicy",
    "FreezeMilestone",
    "FreezePolicy",
    "ManualPolicy",
    "SIGNAL_NAMES",
    "Signals",
    "StaticPolicy",
    "check_freeze_policy_contract",
    "sp_loss",
]
