"""How many requests a batch keeps in flight: additive increase, multiplicative decrease on the
load of its models' instances, so batch work fills idle capacity and yields it to live traffic.

The signals are vLLM's own gauges, summed over the model's running instances
(``vllm:num_requests_waiting`` and ``vllm:num_requests_running``: tasks/autoscale/signals.py):

- **live requests in the engines**: running + waiting, less the batch's own requests in flight.
  Above ``batch_max_live`` (0) the batch halves its concurrency: while live traffic is there, a
  batch sequence beside it slows its steps (on a CPU, or a GPU near its compute bound), so the
  batch shrinks towards one request at a time instead of competing;
- **the queue**: once the engines admit no more (``max_num_seqs`` full), every request beyond
  waits, live ones behind the batch's. Above ``batch_max_waiting`` (0) the batch comes down to
  what the engines run: with no live traffic there every request in them is the batch's, so
  the queue says where the engines' capacity is, not that anyone needs room (halving there
  left the engines half empty until it grew back, one request a read).

Otherwise it grows each ``interval_s``. Until its first back-off a clear read sets the ceiling:
the first read comes before the first request, an engine without live traffic has no one to
yield to, and a queue of the batch's own brings it to what the engines run at the next read
(a slow start of 2, 4, 8, 16 cost a 10 s batch of embeddings a good part of its first seconds).
After that it grows by one, and only once ``quiet_reads`` reads in a row saw no live traffic: a
read can fall between two requests of a live client, and one batch sequence more beside live
traffic is what its TTFT pays for (the tail of ``bench/results/batch.json``). After its own
queue the batch grows back at the next clear read. An unreadable signal holds the concurrency
where it is. (AIMD, as TCP congestion control and llm-d's batch gateway do; the numbers are
settings.) The batch's own requests are counted at their most in the interval before a read:
vLLM's gauges lag a step behind requests that just ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx

from modelops.registry import Registry
from tasks.autoscale.signals import read_instance

__all__ = ["Pace", "engine_load"]


class Pace:
    """A concurrency limit that moves with a load signal; ``with pace:`` holds one slot.

    Args:
        max_concurrency: the ceiling (setting ``batch_max_concurrency``).
        max_waiting: the most waiting requests tolerated (setting ``batch_max_waiting``).
        load: reads ``(waiting, in the engines: running + waiting)`` requests now; None when
            unknown.
        max_live: the most requests of others in the engines tolerated (``batch_max_live``).
        interval_s: seconds between reads of ``load``.
        start: the first limit (at most ``max_concurrency``).
        quiet_reads: reads in a row without live traffic before the limit grows by one.
    """

    def __init__(self, max_concurrency: int, max_waiting: int, load: Callable[[], tuple[float, float] | None],
                 max_live: int = 0, interval_s: float = 1.0, start: int = 2, quiet_reads: int = 1) -> None:
        self.max_concurrency, self.max_waiting, self.max_live, self._load = max_concurrency, max_waiting, max_live, load
        self.interval_s, self.quiet_reads = interval_s, max(1, quiet_reads)
        self._clear = 0  # reads in a row without live traffic
        self.limit = max(1, min(start, max_concurrency))
        self.backoffs = 0  # times the limit came down
        self._in_flight = 0
        self._peak = 0  # the most in flight since the last read
        self._fresh = True  # no back-off yet
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="batch-pace", daemon=True)

    def start(self) -> Pace:
        """Read the signal once (the first requests already yield to a queue), then every ``interval_s``."""
        self.step()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)

    def step(self) -> None:
        """Read the signal once and move the limit (also called by the background thread)."""
        read = self._load()
        if read is None:
            return
        waiting, in_engines = read
        with self._cond:
            live = in_engines - self._peak  # requests in the engines that are not this batch's
            self._peak = self._in_flight
            # Only live traffic resets the quiet count: a queue of the batch's own requests says
            # nothing about the gaps between live ones.
            self._clear = 0 if live > self.max_live else self._clear + 1
            if live > self.max_live or waiting > self.max_waiting:
                # Yield to live traffic; for a queue of its own, hold what the engines run.
                fits = self.limit // 2 if live > self.max_live else int(in_engines - waiting) + self.max_waiting
                if self.limit > 1:
                    self.backoffs += 1
                self.limit, self._fresh = max(1, min(self.limit - 1, fits)), False
            elif self._fresh:
                self.limit = self.max_concurrency
            elif self._clear >= self.quiet_reads:
                self.limit = min(self.max_concurrency, self.limit + 1)
            self._cond.notify_all()

    def _follow(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.step()

    def __enter__(self) -> Pace:
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight < self.limit)
            self._in_flight += 1
            self._peak = max(self._peak, self._in_flight)
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()


def engine_load(registry: Registry, model_ids: set[str],
                client: httpx.Client) -> Callable[[], tuple[float, float] | None]:
    """A ``load`` signal for :class:`Pace`: ``(waiting, running + waiting)`` requests in the
    engines of every running instance of ``model_ids`` (their merged ``/metrics``); None when
    none answered."""

    def load() -> tuple[float, float] | None:
        samples = [s for m in model_ids for i in registry.instances(m) if i.state == "running"
                   if (s := read_instance(i.endpoints.get("metrics", ""), client)) is not None]
        if not samples:
            return None
        return sum(s.waiting for s in samples), sum(s.waiting + s.running for s in samples)

    return load
