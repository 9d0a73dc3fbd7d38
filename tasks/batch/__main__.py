"""``python -m tasks.batch``: the batch API daemon (``modelops up`` starts it, ``down`` stops it)."""

from __future__ import annotations

import logging
import threading

from modelops.settings import Settings
from tasks.batch.api import serve


def main() -> None:
    # force: importing Prefect configures the root logger for its own use.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    serve(Settings(), threading.Event())


if __name__ == "__main__":
    main()
