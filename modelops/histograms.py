"""Statistics of Prometheus histograms and counts: the text format parsed, quantiles of cumulative
``le`` buckets (``{upper bound: cumulative count}``), and the intervals experiments compare arms with."""

from __future__ import annotations

import math
import re
from collections import defaultdict

__all__ = ["histogram_quantile", "interpolated_quantile", "parse_prometheus", "quantile_interval", "wilson_interval"]


_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([^\s]+)')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``{metric name: [(labels, value)]}`` from Prometheus text format (comments skipped)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        try:
            out[m.group(1)].append((labels, float(m.group(3))))
        except ValueError:
            continue
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` of a cumulative histogram; None
    when it is empty."""
    if not buckets:
        return None
    total = max(buckets.values())
    if total <= 0:
        return None
    for le in sorted(buckets):
        if buckets[le] >= q * total:
            return le
    return math.inf


def interpolated_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Quantile ``q`` of a cumulative histogram, interpolated linearly within the bucket that
    holds it, as Prometheus' ``histogram_quantile`` does (the lowest bucket starts at 0; a
    quantile in the ``+Inf`` bucket is the highest finite bound). None when it is empty."""
    if not buckets or (total := max(buckets.values())) <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in sorted(buckets):
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def wilson_interval(successes: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % for z = 1.96); (0, 1) when ``n`` is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # It holds p; the bounds say so exactly (at p = 0 rounding left 3e-17 above the estimate).
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


def quantile_interval(q: float, buckets: dict[float, float], z: float = 1.96) -> tuple[float, float, float] | None:
    """``(low, estimate, high)`` of quantile ``q`` of a cumulative histogram: the estimate as
    :func:`interpolated_quantile`, the interval the order-statistic one, the quantiles at
    ``q -+ z sqrt(q (1 - q) / n)`` (95 % for z = 1.96). None when it is empty."""
    if not buckets or (n := max(buckets.values())) <= 0:
        return None
    spread = z * math.sqrt(q * (1 - q) / n)
    return (interpolated_quantile(max(q - spread, 0.0), buckets), interpolated_quantile(q, buckets),
            interpolated_quantile(min(q + spread, 1.0), buckets))
