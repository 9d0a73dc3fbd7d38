"""A client in a process of its own: another tenant's flood, a live user, a batch's stand-in.

Benchmarks that measure one client while another loads the server start the other here, so the
measured client's event loop and GIL are not shared with the load (they would not be in use:
two tenants are two machines), and the measured client too when it runs beside a batch runner.

    python -m bench._load URL PATH BODY_JSON [--streams N] [--key KEY] [--ttft]

``streams`` threads send ``BODY_JSON`` to ``URL`` + ``PATH`` back to back until SIGTERM; each
``{i}`` in the body's text becomes a count of the requests sent (new prompts: no prefix-cache
hits). A 429 is sent again after 50 ms, as a client that floods does. With ``--ttft`` (a streamed
body) each answer's time to its first content chunk, in seconds, is printed on a line of its
own as it comes; at SIGTERM the last line is ``{"answered": N, "refused_429": N, "other": N}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import threading
import time

import httpx


def _has_content(line: str) -> bool:
    """Whether an SSE line carries generated text (an OpenAI chat or completion chunk)."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content") or choices[0].get("text"))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench._load")
    p.add_argument("url")
    p.add_argument("path")
    p.add_argument("body", help="the request's JSON; each {i} in it becomes the request's number")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--key", default=None, help="API key (Authorization: Bearer)")
    p.add_argument("--ttft", action="store_true", help="print each answer's TTFT (s)")
    args = p.parse_args()
    counter, lock = itertools.count(), threading.Lock()
    got = {"answered": 0, "refused_429": 0, "other": 0}
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}

    def worker() -> None:
        with httpx.Client(timeout=600, headers=headers) as client:
            while True:
                body = json.loads(args.body.replace("{i}", str(next(counter))))
                t0, first, status = time.perf_counter(), None, 0
                try:
                    with client.stream("POST", args.url + args.path, json=body) as r:
                        for line in r.iter_lines():  # read to the end: the next request waits for this one
                            if args.ttft and first is None and _has_content(line):
                                first = time.perf_counter() - t0
                        status = r.status_code
                except httpx.HTTPError:
                    pass  # counted as "other"; the server may be going away
                outcome = {200: "answered", 429: "refused_429"}.get(status, "other")
                with lock:
                    got[outcome] += 1
                    if first is not None and status == 200:
                        print(first, flush=True)
                if status != 200:
                    time.sleep(0.05)

    def stop(*_) -> None:
        with lock:
            print(json.dumps(got), flush=True)
            sys.stdout.flush()
            os._exit(0)  # the workers are mid-request: no clean way to end them

    signal.signal(signal.SIGTERM, stop)
    for _ in range(args.streams):
        threading.Thread(target=worker, daemon=True).start()
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
