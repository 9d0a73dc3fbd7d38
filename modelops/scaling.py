"""How many instances a version runs: the manifest's ``scaling:`` and the decision rule.

A version runs between ``min`` and ``max`` instances. When ``max > min`` the autoscaler
(:mod:`tasks.autoscale`) reads one LLM signal from every instance of the version and asks for

    desired = ceil(instances × per-instance signal / target)

the rule of Kubernetes' HorizontalPodAutoscaler and of KEDA's Prometheus trigger with an
``AverageValue`` target (kubernetes.io, "Horizontal Pod Autoscaling", algorithm details). A
ratio within 10 % of 1 changes nothing (the HPA's default tolerance). Each recommendation is
remembered; a version scales up to the *lowest* recommendation of the last
``scale_up_window_s`` and down to the *highest* of the last ``scale_down_window_s`` (the HPA's
stabilization windows): a burst shorter than the up window starts nothing, a lull shorter than
the down window stops nothing. A window must be covered by recommendations before it decides,
so an autoscaler that just started (or just acted) waits a whole window first.

Signals, per instance (averaged over the version's instances):

- ``waiting``: requests queued in the engine (vLLM's ``vllm:num_requests_waiting``);
- ``kv_cache``: the fraction of the KV cache in use, 0..1 (``vllm:kv_cache_usage_perc``);
- ``ttft_p90_s``: the 90th percentile of time to first token, in seconds, over the requests of
  the last ``autoscale_ttft_window_s`` (vLLM's ``vllm:time_to_first_token_seconds`` histogram);
  a window without requests reads 0 (idle).

Scale from zero (``min: 0``): a version goes to zero instances only once it was idle (no request
running, waiting or finished on any instance) for a whole ``scale_down_window_s``; while it has
none, the router holds its requests and the autoscaler starts one at the first
(:mod:`tasks.autoscale.activator`). ``{min: 0, max: 1}`` needs no target: idle or not decides.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

__all__ = ["SIGNALS", "Recommender", "Scaling", "ScalingTarget", "desired_instances"]

# Target field → (what it measures, the bound on its value), for errors and docs.
SIGNALS = {
    "waiting": "requests waiting in the engine's queue, per instance (> 0)",
    "kv_cache": "fraction of the KV cache in use, per instance (0 < value <= 1)",
    "ttft_p90_s": "time to first token, 90th percentile over the window, seconds (> 0)",
}
TOLERANCE = 0.1  # the HPA's default: a ratio within 10 % of 1 changes nothing


class ScalingTarget(BaseModel):
    """The one signal a version scales on and the value per instance it keeps: exactly one of
    ``waiting`` (requests), ``kv_cache`` (fraction, ≤ 1) or ``ttft_p90_s`` (seconds); see the
    module docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # strict: a YAML `true` is not a number (int → float is still taken)
    waiting: float | None = Field(default=None, gt=0, le=100000, strict=True)
    kv_cache: float | None = Field(default=None, gt=0, le=1, strict=True)
    ttft_p90_s: float | None = Field(default=None, gt=0, le=3600, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _one_known_signal(cls, data: Any) -> Any:
        if isinstance(data, ScalingTarget):
            return data
        choices = "; ".join(f"{k}: {v}" for k, v in SIGNALS.items())
        if not isinstance(data, dict) or len(data) != 1:
            raise ValueError(f"got {data!r}: give one signal and its value per instance, e.g. target: {{waiting: 2}} "
                             f"({choices})")
        ((name, value),) = data.items()
        if name not in SIGNALS:
            raise ValueError(f"{name!r} is not a scaling signal; use one of {', '.join(SIGNALS)} ({choices})")
        if value is None:
            example = {"waiting": 2, "kv_cache": 0.8, "ttft_p90_s": 1.5}[name]
            raise ValueError(f"{name}: no value; give the {SIGNALS[name]}, e.g. target: {{{name}: {example}}}")
        return data

    @model_serializer(mode="wrap")
    def _dump(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}  # the one signal: {waiting: 2}

    @property
    def signal(self) -> str:
        """The signal's name (a key of :data:`SIGNALS`)."""
        return next(k for k in SIGNALS if getattr(self, k) is not None)

    @property
    def value(self) -> float:
        """The value per instance the autoscaler keeps the signal at."""
        return getattr(self, self.signal)

    def __str__(self) -> str:
        return f"{self.signal} {self.value:g}"


class Scaling(BaseModel):
    """A version's instance count policy (see the module docstring).

    Fields:
        min: instances the version always runs (0..; 0 scales to zero when idle and starts one
            at the first request, see the module docstring).
        max: the most it runs (≥ min; at most the ``autoscale_max_instances`` setting, checked
            at announce).
        target: the signal and its value per instance (:class:`ScalingTarget`); required when
            ``max > min``.
        scale_up_window_s: seconds the signal must ask for more before instances start (0..3600).
        scale_down_window_s: seconds it must ask for fewer before instances drain (0..3600, the
            HPA's bound on a stabilization window).

    The default, ``min = max = 1``, is one instance and no autoscaling; a fixed count of n is
    ``{min: n, max: n}`` (``max`` defaults to 1).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # strict: a YAML `true` is not a count (`max: true` would be 1, autoscaling silently off)
    min: int = Field(default=1, le=1024, strict=True)
    max: int = Field(default=1, ge=1, le=1024, strict=True)
    target: ScalingTarget | None = None
    scale_up_window_s: float = Field(default=10.0, ge=0, le=3600, strict=True)
    scale_down_window_s: float = Field(default=120.0, ge=0, le=3600, strict=True)

    @model_validator(mode="after")
    def _bounds(self) -> "Scaling":
        if self.min < 0:
            raise ValueError(f"min: {self.min} instances; give 0 or more")
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max}); set min <= max")
        if self.min == 0 and self.max == 1 and self.target is not None:
            raise ValueError(f"target: {self.target} does nothing with min 0 and max 1: idleness alone decides (zero "
                             "when idle, one at the first request); remove target, or raise max to scale on it")
        if self.max > max(1, self.min) and self.target is None:
            above = f"min ({self.min})" if self.min else "1 (min 0 alone scales between 0 and 1, on idleness)"
            raise ValueError(f"target: required when max ({self.max}) is above {above}: the signal to scale on, "
                             f"e.g. target: {{waiting: 2}} (one of {', '.join(SIGNALS)})")
        return self

    @property
    def autoscaled(self) -> bool:
        """Whether the autoscaler changes this version's count (``max > min``)."""
        return self.max > self.min

    def clamp(self, count: int) -> int:
        """``count`` within ``[min, max]``."""
        return max(self.min, min(self.max, count))


def desired_instances(policy: Scaling, current: int, per_instance: float) -> int:
    """The HPA rule: ``ceil(current × per_instance / target)`` within ``[min, max]``, or
    ``current`` when the ratio is within :data:`TOLERANCE` of 1.

    Args:
        current: instances running now (≥ 1).
        per_instance: the signal's mean over them (its unit is the target's).

    Raises:
        ValueError: the policy has no target, or ``current`` < 1.
    """
    if policy.target is None or current < 1:
        raise ValueError(f"no recommendation without a target and an instance (target {policy.target}, "
                         f"current {current})")
    ratio = per_instance / policy.target.value
    if abs(ratio - 1) <= TOLERANCE:
        return policy.clamp(current)
    return policy.clamp(math.ceil(round(current * ratio, 9)))  # round: 2 × 1.5 / 1.5 is exactly 2


@dataclass
class Recommender:
    """Stabilized decisions for one version: :meth:`observe` each recommendation (``t`` in
    seconds, any monotonic clock), :meth:`decide` the count to go to now.

    Args:
        policy: the version's scaling policy.
    """

    policy: Scaling

    def __post_init__(self) -> None:
        self._seen: deque[tuple[float, int]] = deque()
        self._since: float | None = None  # when recommendations started (or last reset)

    def observe(self, t: float, desired: int) -> None:
        """Record the recommendation ``desired`` made at ``t``."""
        if self._since is None:
            self._since = t
        self._seen.append((t, desired))
        keep = max(self.policy.scale_up_window_s, self.policy.scale_down_window_s)
        while self._seen and self._seen[0][0] < t - keep:
            self._seen.popleft()

    def reset(self) -> None:
        """Forget every recommendation (after acting, or after data went missing): each window
        must be covered again before the next decision."""
        self._seen.clear()
        self._since = None

    def decide(self, t: float, current: int) -> int:
        """The count to go to at ``t`` from ``current``: up to the lowest recommendation of the
        up window, down to the highest of the down window, else ``current`` (also while a window
        is not yet covered). Always within ``[min, max]``."""
        if (bounded := self.policy.clamp(current)) != current or self._since is None:
            return bounded  # a count outside [min, max] (a policy changed) goes back at once
        for window, pick, better in ((self.policy.scale_up_window_s, min, lambda n: n > current),
                                     (self.policy.scale_down_window_s, max, lambda n: n < current)):
            if t - self._since < window:
                continue
            n = pick((d for s, d in self._seen if s >= t - window), default=self._seen[-1][1]) if window \
                else self._seen[-1][1]
            if better(n):
                return n
        return current
