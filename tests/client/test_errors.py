"""The client raises the classes of ``actcache.errors``: a bad argument is a ConfigError (still a ValueError),
a call out of order a LifecycleError (still a RuntimeError), and the message names the knob to change."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import actcache_client
from actcache.errors import ActCacheError, ConfigError, LifecycleError
from actcache_client import cost_model
from actcache_client.engine._planner import PlannerConfig
from actcache_client.layouts._stages import Stage, StagedModel, auto_partition, from_sequential
from actcache_client.models import CifarResNet
from actcache_client.transport._device_staging import HostRing

# Every module of the client: each raise is a class of actcache.errors (or an ImportError for an optional dependency).
CLIENT = Path(actcache_client.__file__).parent
CHECKED = sorted(str(p.relative_to(CLIENT)) for p in CLIENT.rglob("*.py"))
BARE = {"ValueError", "RuntimeError", "TypeError", "Exception", "AssertionError"}
# The policy contract check (check_freeze_policy_contract) is a test helper for custom policies: it fails like an assert.
ALLOWED = {"freeze/policy.py": {"AssertionError"}}


@pytest.mark.parametrize("name", CHECKED)
def test_no_bare_builtin_errors(name: str) -> None:
    tree = ast.parse((CLIENT / name).read_text())
    bare = [
        f"line {node.lineno}: {node.exc.func.id}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
        and isinstance(node.exc.func, ast.Name) and node.exc.func.id in BARE - ALLOWED.get(name, set())
    ]
    assert not bare, f"actcache_client/{name} raises builtin errors; use actcache.errors: {bare}"


@pytest.mark.parametrize(
    ("call", "knob"),
    [
        (lambda: StagedModel([Stage("a", nn.ReLU())]).run(torch.zeros(1), 0, 2), "StagedModel.run"),
        (lambda: StagedModel([Stage("a", nn.ReLU())]).suffix(1), "StagedModel.suffix"),
        (lambda: from_sequential(nn.Sequential(nn.ReLU(), nn.ReLU()), groups=[3]), "from_sequential: groups"),
        (lambda: auto_partition(from_sequential(nn.Sequential(nn.ReLU())), max_stages=0), "auto_partition: max_stages"),
        (lambda: cost_model.cached_subset(1, 2.0), "cached_subset: fraction"),
        (lambda: cost_model.should_replan(None, None, drift=-1.0), "should_replan: drift"),  # type: ignore[arg-type]
        (lambda: PlannerConfig(window=0), "PlannerConfig.window"),
        (lambda: CifarResNet(0), "blocks_per_layer"),
        (lambda: HostRing(slots=1), "HostRing(slots=)"),
    ],
)
def test_bad_arguments_are_config_errors_naming_the_knob(call, knob: str) -> None:
    with pytest.raises(ConfigError) as info:
        call()
    assert isinstance(info.value, ValueError) and isinstance(info.value, ActCacheError)
    assert knob in str(info.value)


def test_calls_out_of_order_are_lifecycle_errors() -> None:
    ring = HostRing(slots=2)
    for call in (lambda: ring.alloc((2,), torch.float32), lambda: ring.release(None)):
        with pytest.raises(LifecycleError, match="before acquire") as info:
            call()
        assert isinstance(info.value, RuntimeError)
