"""The local stack's S3 endpoint: moto's standalone server, with its buckets kept on disk.

moto keeps every bucket in memory, so `modelops down` / `up` used to empty it: a user's
uploaded weights were gone and announcing from the same ``s3://`` source failed with
``NoSuchBucket``. This process serves moto's S3 API over HTTP exactly as ``moto_server`` does
and keeps moto's S3 state in ``<home>/s3/state.pickle``:

- restored when it starts (before it answers), ETags, metadata and multipart part sizes
  included (moto drops a completed upload's part bodies when it pickles them; their sizes are
  recorded beside the state and the parts rebuilt from the object);
- written (atomically: a temporary file renamed over the old one) a few seconds after any
  request that changed something (PUT, POST, DELETE), and once more on SIGTERM, so a crash loses
  at most the last few seconds of writes.

Run: ``python -m modelops_cli.local_s3 --host 127.0.0.1 --port 4566 --state DIR/state.pickle``.
The state file is a pickle of this stack's own data, read only from its own home.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger("modelops.s3")

SAVE_AFTER_S = 3.0  # a burst of uploads is saved once, shortly after it ends
_CHANGES = {"PUT", "POST", "DELETE"}


def _keys(backends):
    """Every (bucket, key name, FakeKey) of moto's S3 state (all accounts and partitions)."""
    for account in backends.values():
        for backend in account.values():
            for bucket in backend.buckets.values():
                for name, key in bucket.keys.items():
                    yield bucket.name, name, key


def save(backends, path: Path) -> None:
    """Write moto's S3 state to ``path`` atomically, with each multipart object's part sizes."""
    parts = {(b, n): [(num, part.size) for num, part in sorted(key.multipart.parts.items())]
             for b, n, key in _keys(backends) if getattr(key, "multipart", None)}
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        pickle.dump({"backends": backends, "parts": parts}, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def restore(backends, path: Path) -> int:
    """Load ``path`` into moto's (empty) S3 state in place; returns the objects restored."""
    with path.open("rb") as f:
        state = pickle.load(f)  # noqa: S301 - this stack's own file
    backends.update(state["backends"])
    count = 0
    for bucket, name, key in _keys(backends):
        count += 1
        sizes = state["parts"].get((bucket, name))
        if sizes:
            value, offset = key.value, 0
            for num, size in sizes:
                key.multipart.parts[num].value = value[offset:offset + size]
                offset += size
    return count


class _Tracker:
    """WSGI middleware: marks the state dirty after a request that may change it."""

    def __init__(self, app) -> None:
        self.app, self.dirty = app, threading.Event()

    def __call__(self, environ, start_response):
        if environ.get("REQUEST_METHOD") in _CHANGES:
            self.dirty.set()
        return self.app(environ, start_response)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--state", type=Path, required=True, help="the state file (created on the first change)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from moto.s3.models import s3_backends
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    args.state.parent.mkdir(parents=True, exist_ok=True)
    if args.state.is_file():
        t0 = time.monotonic()
        n = restore(s3_backends, args.state)
        log.info("restored %d object(s) from %s in %.1f s", n, args.state, time.monotonic() - t0)
    else:
        log.info("no saved state at %s: starting empty", args.state)
    app = _Tracker(DomainDispatcherApplication(create_backend_app))
    server = make_server(args.host, args.port, app, threaded=True)
    lock = threading.Lock()

    def save_now(why: str) -> None:
        with lock:
            app.dirty.clear()
            t0 = time.monotonic()
            save(s3_backends, args.state)
            log.info("saved the S3 state (%s) in %.1f s", why, time.monotonic() - t0)

    def saver() -> None:
        while True:
            app.dirty.wait()
            time.sleep(SAVE_AFTER_S)
            try:
                save_now("after changes")
            except Exception:  # noqa: BLE001 - a failed save is retried after the next change
                log.exception("saving the S3 state failed")
                app.dirty.set()

    def stop(signum, _frame) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=saver, name="s3-saver", daemon=True).start()
    log.info("moto S3 on http://%s:%d, state %s", args.host, args.port, args.state)
    server.serve_forever()
    with lock:  # a save in progress ends first
        pass
    if app.dirty.is_set():
        save_now("at shutdown")


if __name__ == "__main__":
    main()
