"""How many requests a batch keeps in flight: additive increase, multiplicative decrease on the
load of its models' instances, so batch work fills idle capacity and yields it to live traffic.

The signal is vLLM's own queue (``vllm:num_requests_waiting``, summed over the model's running
instances: tasks/autoscale/signals.py): once the engines admit no more (their ``max_num_seqs``
is full), every request beyond waits, live ones behind the batch's. Above
``batch_max_waiting`` the batch halves its concurrency; at or below it, it adds one each
``interval_s``. An unreadable signal holds the concurrency where it is. (As llm-d's batch
gateway and AIMD congestion control do; the numbers are settings.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx

from modelops.registry import Registry
from tasks.autoscale.signals import read_instance

__all__ = ["Pace", "queue_reader"]


class Pace:
    """A concurrency limit that moves with a load signal; ``with pace:`` holds one slot.

    Args:
        max_concurrency: the ceiling (setting ``batch_max_concurrency``).
        max_waiting: the most waiting requests tolerated (setting ``batch_max_waiting``).
        waiting: reads the current number of waiting requests; None when unknown.
        interval_s: seconds between reads of ``waiting``.
        start: the first limit (at most ``max_concurrency``).
    """

    def __init__(self, max_concurrency: int, max_waiting: int, waiting: Callable[[], float | None],
                 interval_s: float = 2.0, start: int = 2) -> None:
        self.max_concurrency, self.max_waiting, self._waiting = max_concurrency, max_waiting, waiting
        self.interval_s = interval_s
        self.limit = max(1, min(start, max_concurrency))
        self.backoffs = 0  # times the limit was halved
        self._in_flight = 0
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
        waiting = self._waiting()
        if waiting is None:
            return
        with self._cond:
            if waiting > self.max_waiting:
                if self.limit > 1:
                    self.backoffs += 1
                self.limit = max(1, self.limit // 2)
            else:
                self.limit = min(self.max_concurrency, self.limit + 1)
            self._cond.notify_all()

    def _follow(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.step()

    def __enter__(self) -> Pace:
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight < self.limit)
            self._in_flight += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()


def queue_reader(registry: Registry, model_ids: set[str], client: httpx.Client) -> Callable[[], float | None]:
    """A ``waiting`` signal for :class:`Pace`: the requests waiting in the engines of every
    running instance of ``model_ids`` (their merged ``/metrics``); None when none answered."""

    def waiting() -> float | None:
        samples = [read_instance(i.endpoints.get("metrics", ""), client) for m in model_ids
                   for i in registry.instances(m) if i.state == "running"]
        read = [s.waiting for s in samples if s is not None]
        return sum(read) if read else None

    return waiting
