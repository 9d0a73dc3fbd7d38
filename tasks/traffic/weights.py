"""Version weights → server weights, so each version's share of a model's traffic is exact.

A router weighs servers, not versions: a server's share of a backend is its weight over the sum
of all the backend's weights (HAProxy: ``weight`` 0..256 per server, "configuration manual",
section 5.2). Splitting a version's registry weight ``w`` over its ``n`` servers as
``round(w / n)`` each gives the version ``n * round(w / n)``, not ``w``: with 20 servers of v1
at 50 and one of v2 at 50, v1 weighs 20 × 3 = 60 and v2 gets 50 / 110 = 45 % instead of 50 %
(the drift argo-rollouts fixed in PR #1759).

:func:`server_weights` instead gives every version a total of exactly ``w × m`` for one
multiplier ``m`` shared by all versions of the model, split over its servers as evenly as
integers allow (each gets ``⌊w·m/n⌋`` or one more), so the version's share is ``w / Σw`` exactly.
``m`` is the smallest that splits every version evenly when that fits under the 256 cap, else
the largest that fits (the uneven split is then at most one unit in ~``256 · n / w``). When a
version has more servers than ``w × m`` units (a version at 10 with 64 servers beside one at 90
on a single server), some of its servers get weight 0: they stay reachable by version pin and
take no default traffic, and the share stays exact.
"""

from __future__ import annotations

from math import gcd

__all__ = ["MAX_SERVER_WEIGHT", "server_weights"]

MAX_SERVER_WEIGHT = 256
"""HAProxy's largest server weight (configuration manual, "weight <weight>": 0..256)."""


def _split(total: int, n: int) -> list[int]:
    base, extra = divmod(total, n)
    return [base + 1] * extra + [base] * (n - extra)


def server_weights(versions: dict[str, tuple[int, int]], cap: int = MAX_SERVER_WEIGHT) -> dict[str, list[int]]:
    """Per-server weights of one model's versions.

    Args:
        versions: ``{version: (registry weight >= 0, number of servers >= 1)}``.
        cap: the router's largest server weight.

    Returns:
        ``{version: [weight of each server]}``: each list has the version's number of servers,
        values in ``0..cap``, summing to ``weight × m`` with one ``m >= 1`` for the whole model
        (all zeros for a version at weight 0).

    Raises:
        ValueError: a negative weight, or a version with no servers.
    """
    for version, (weight, n) in versions.items():
        if weight < 0 or n < 1:
            raise ValueError(f"version {version}: weight {weight} with {n} servers; need weight >= 0, servers >= 1")
    live = {v: (w, n) for v, (w, n) in versions.items() if w > 0}
    if not live:
        return {v: [0] * n for v, (_, n) in versions.items()}
    # The largest m whose busiest server stays under the cap: ceil(w·m / n) <= cap.
    largest = min(cap * n // w for w, n in live.values())
    # The smallest m that splits every version evenly: n / gcd(w, n) divides m for each version.
    even = 1
    for w, n in live.values():
        step = n // gcd(w, n)
        even = even * step // gcd(even, step)
    m = even if even <= largest else max(1, largest)
    return {v: _split(w * m, n) if w > 0 else [0] * n for v, (w, n) in versions.items()}
