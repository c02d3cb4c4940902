"""What a run gets when the user names no policy or no interval: both follow from the run's length.

``docs/guides/freeze-policies.md`` has the measurements behind the rule.
"""

from __future__ import annotations

import math

from actcache.errors import ConfigError
from actcache_client.freeze.autofreeze import AutoFreezePolicy
from actcache_client.freeze.egeria import EgeriaConfig, EgeriaPolicy
from actcache_client.freeze.policy import FreezePolicy
from actcache_client.freeze.static import NoFreezePolicy

__all__ = ["MIN_INTERVAL", "autofreeze_eval_every", "default_policy", "egeria_eval_every", "eval_every_for",
           "run_length"]

#: Fewest steps between evaluations of the default policy; a shorter run does not freeze (see default_policy).
MIN_INTERVAL = 4
#: The default policy's Egeria settings: the paper's detector, freezing only once the lr has halved.
DEFAULT_EGERIA = EgeriaConfig(freeze_lr_fraction=0.5)


def egeria_eval_every(total_steps: int, num_stages: int, window: int) -> int:
    """Egeria's interval n: ``total_steps / (2W) / num_stages / 1.75`` (2W evaluations per stage fit in the
    first 1/1.75 of training), at least 1.

    Args:
        total_steps: The run's optimizer steps.
        num_stages: The model's stages.
        window: The policy's W.
    """
    return max(1, round(total_steps / (2 * window) / num_stages / 1.75))


def autofreeze_eval_every(steps_per_epoch: int, intervals_per_epoch: int) -> int:
    """AutoFreeze's interval T: an epoch's steps / ``intervals_per_epoch`` (the paper: 5), at least 1.

    Args:
        steps_per_epoch: Optimizer steps per epoch.
        intervals_per_epoch: Evaluations per epoch.
    """
    return max(1, steps_per_epoch // intervals_per_epoch)


def _positive(name: str, value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{name}={value!r} must be a positive number of steps (or epochs), or None")
    return value


def run_length(total_steps: int | None = None, steps_per_epoch: int | None = None,
               epochs: int | None = None) -> int | None:
    """The run's optimizer steps: ``total_steps``, else ``steps_per_epoch * epochs``; None when unknown.

    Args:
        total_steps: The run's optimizer steps.
        steps_per_epoch: Optimizer steps per epoch.
        epochs: The run's epochs.

    Raises:
        ConfigError: A value is not a positive int, or only one of ``steps_per_epoch`` and ``epochs``.
    """
    total, per_epoch, count = (_positive("total_steps", total_steps), _positive("steps_per_epoch", steps_per_epoch),
                               _positive("epochs", epochs))
    if (per_epoch is None) != (count is None):
        given = "steps_per_epoch" if per_epoch is not None else "epochs"
        raise ConfigError(f"{given} alone does not give the run's length: pass both steps_per_epoch "
                          "(e.g. len(loader) / gradient accumulation) and epochs, or total_steps")
    if per_epoch is None or count is None:
        return total
    if total is not None and total != per_epoch * count:
        raise ConfigError(f"total_steps={total} disagrees with steps_per_epoch={per_epoch} x epochs={count} = "
                          f"{per_epoch * count}; pass one or the other")
    return per_epoch * count


def default_policy(total_steps: int | None, num_stages: int) -> tuple[FreezePolicy, int]:
    """The policy and evaluation interval of a run of ``total_steps`` optimizer steps on ``num_stages`` stages.

    Length unknown, fewer than 2 stages, or under ``MIN_INTERVAL`` steps per
    evaluation: ``NoFreezePolicy``, saying why. Else ``EgeriaPolicy`` at the
    paper's settings, every :func:`egeria_eval_every` steps, freezing a stage
    only once the lr has fallen to half its peak (a constant lr never freezes).

    Args:
        total_steps: The run's optimizer steps (None: unknown).
        num_stages: The model's stages.

    Returns:
        The policy and its evaluation interval in steps.
    """
    if num_stages < 2:
        return NoFreezePolicy(f"the model has {num_stages} stage(s) and the head always trains: nothing can "
                              "freeze; stage the model into several stages"), max(total_steps or 1, 1)
    if total_steps is None:
        return NoFreezePolicy("the run's length is unknown, so the default freeze policy cannot pace itself: "
                              "pass FreezeController(..., total_steps=N) or steps_per_epoch= and epochs=, "
                              "or a policy and eval_every"), 1000
    every = egeria_eval_every(total_steps, num_stages, DEFAULT_EGERIA.window)
    if every < MIN_INTERVAL:
        need = math.ceil((MIN_INTERVAL - 0.5) * 2 * DEFAULT_EGERIA.window * num_stages * 1.75)
        return NoFreezePolicy(f"a run of {total_steps} steps is too short for the default freeze policy on "
                              f"{num_stages} stages: it gives {every} step(s) per evaluation, below {MIN_INTERVAL}; "
                              f"it needs at least {need} steps. Nothing will freeze; to freeze anyway pass a "
                              "policy and eval_every (e.g. StaticPolicy)"), total_steps
    return EgeriaPolicy(DEFAULT_EGERIA), every


def eval_every_for(policy: FreezePolicy, *, total_steps: int | None, steps_per_epoch: int | None,
                   num_stages: int) -> int:
    """The interval a named policy gets when ``eval_every`` is left out.

    Args:
        policy: The policy.
        total_steps: The run's optimizer steps (EgeriaPolicy needs it).
        steps_per_epoch: Optimizer steps per epoch (AutoFreezePolicy needs it).
        num_stages: The model's stages.

    Raises:
        ConfigError: The policy needs a length that is not given, or is of another type.
    """
    if isinstance(policy, EgeriaPolicy) and total_steps is not None:
        return egeria_eval_every(total_steps, num_stages, policy.config.window)
    if isinstance(policy, AutoFreezePolicy) and steps_per_epoch is not None:
        return autofreeze_eval_every(steps_per_epoch, policy.config.intervals_per_epoch)
    if isinstance(policy, NoFreezePolicy):
        return total_steps or 1000
    raise ConfigError(f"{type(policy).__name__} needs eval_every (steps between evaluations): pass it, or the run's "
                      "length (total_steps= for EgeriaPolicy, steps_per_epoch= for AutoFreezePolicy) to derive it")
