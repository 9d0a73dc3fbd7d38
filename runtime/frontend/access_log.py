"""Instance logs for people: the probes and scrapes are not logged one by one.

A serving instance is asked ``GET /ready`` every second by the router's health check and by
the supervisors, and ``GET /metrics`` by every scrape (each of which fetches Triton's metrics
with httpx). Logged per request they were 96 % of an instance's log after 40 minutes (13,903
of 14,424 lines), and ``modelops logs`` showed nothing else. What they tell is logged once,
when it changes: the warm-up ("ready"), engine stalls and deaths, the drain.
"""

from __future__ import annotations

import logging

__all__ = ["PROBE_PATHS", "quiet_probes"]

PROBE_PATHS = ("/health", "/ready", "/metrics")


class _ProbeFilter(logging.Filter):
    """Drops uvicorn access records of GET requests to :data:`PROBE_PATHS` (its record args:
    client address, method, path, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and args[1] == "GET" and str(args[2]).split("?", 1)[0] in PROBE_PATHS)


def quiet_probes() -> None:
    """Install the filter on uvicorn's access log and keep httpx's per-request INFO lines
    (the /metrics merge fetching Triton's metrics) out of the instance log."""
    logging.getLogger("uvicorn.access").addFilter(_ProbeFilter())
    logging.getLogger("httpx").setLevel(logging.WARNING)
