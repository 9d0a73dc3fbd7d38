"""``python -m tasks.autoscale``: the local autoscaler daemon (``modelops up`` starts it, ``down``
stops it with SIGTERM: the loop ends after its tick, scale actions in flight finish)."""

from __future__ import annotations

import logging
import signal
import threading

from tasks.autoscale.loop import Autoscaler


def main() -> None:
    # force: importing Prefect (tasks.backends) configures the root logger for its own use.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per metrics read otherwise
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    Autoscaler().run(stopping.is_set)
    logging.getLogger("tasks.autoscale").info("autoscaler stopped")


if __name__ == "__main__":
    main()
