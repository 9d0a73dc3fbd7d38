"""Run one batch: read its input file, answer each line through the router (or from the result
cache), write the answers chunk by chunk, then the output and error files.

Resumable: every ``chunk_lines`` lines are written whole to S3 before the batch's counts move
(tasks/batch/files.py), and a runner that starts on a batch skips the lines its chunks hold. A
runner holds the batch by a lease renewed at each chunk and every quarter of
``batch_stale_after_s`` (modelops/batch_store.py ``beat``); one that lost it (silent past that,
taken over) stops at its next chunk, and the output keeps each line's first written answer, so
no line is answered twice in it.

A batch is its API key's work: its lines reach the router as that key's requests
(:meth:`~tasks.traffic.interface.Router.key_headers`), within the key's scope, rpm, tpm and
max_concurrency, and their usage counts for the key. A line the key's limits hold back waits for
the router's ``Retry-After`` and goes again: a batch outlasts a quota instead of failing lines.
Answers from the result cache use no engine, no limit and no usage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE

from modelops.batch import (TERMINAL, BatchLine, LineError, cache_key, deterministic, error_line, fresh_answer,
                            output_line, parse_line)
from modelops.batch_store import Batch, BatchStore
from modelops.errors import TrafficError
from modelops.registry import Registry
from modelops.settings import Settings
from modelops.tenancy import ALL_MODELS, KEY_LIMIT_CODES, KeyGrant
from tasks.batch.cache_writer import CacheWriter
from tasks.batch.files import BatchFiles
from tasks.batch.pace import Pace, engine_load
from tasks.traffic.interface import Router

__all__ = ["BatchOutcome", "end_stale", "run_batch", "run_batch_task"]

log = logging.getLogger(__name__)

_RETRIED = (429, 502, 503, 504)  # answers worth another try: the router or an instance was busy or going
_TRIES = 4


@dataclass(frozen=True)
class BatchOutcome:
    """What a runner did: the batch's final ``status`` (or its status when this runner stopped
    early: ``held`` when another runner has it), the lines this runner answered (``sent``
    through the router, ``cached`` from the cache), the lines it found already written, the
    seconds its lines waited in all for the key's limits, and the times its pace came down for
    live traffic or a queue (tasks/batch/pace.py)."""

    batch_id: str
    status: str
    sent: int = 0
    cached: int = 0
    skipped: int = 0
    waited_s: float = 0.0
    backoffs: int = 0


def _grant(registry: Registry, owner: str) -> KeyGrant | None:
    """The grant of the batch's owner (an API key's name), every model and no limit for "" (a
    batch made while the router was open); None when the key is gone (revoked or deleted)."""
    if not owner:
        return KeyGrant("", "", (ALL_MODELS,))
    return next((k.grant() for k in registry.api_keys(include_revoked=False) if k.name == owner), None)


def run_batch(batch_id: str, settings: Settings, registry: Registry, router: Router, *, chunk_lines: int = 64,
              progress: Callable[[int, int], None] = lambda done, total: None) -> BatchOutcome:
    """Answer every line of batch ``batch_id`` not answered yet, then write its output and error
    files and set its final status (``completed``, ``cancelled`` or ``expired``).

    Args:
        chunk_lines: lines answered and written together (a crash loses at most one chunk's work).
        progress: called with (lines done, lines in all) after each chunk.

    Raises:
        KeyError: no batch ``batch_id``.
        botocore.exceptions.ClientError, httpx.HTTPError: S3 or the router failed past their
            retries (the flow marks the batch failed once its task's retries are spent).
    """
    store, files = BatchStore(registry), BatchFiles(settings)
    if store.batch(batch_id) is None:
        raise KeyError(f"no batch {batch_id}")
    runner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    batch = store.claim(batch_id, runner, settings.batch_stale_after_s)
    if batch is None:
        status = store.batch(batch_id).status
        return BatchOutcome(batch_id, status if status in TERMINAL else "held")
    grant = _grant(registry, batch.owner)
    try:
        as_key = router.key_headers(batch.owner) if batch.owner and grant is not None else {}
    except TrafficError as e:
        log.warning("batch %s: %s", batch_id, e)
        grant = None
    if grant is None:
        store.update(batch_id, status="failed", errors_json=_errors("key_revoked", f"the API key {batch.owner!r} that "
                                                                    "created this batch was revoked"))
        return BatchOutcome(batch_id, "failed")
    if store.file(batch.input_file_id) is None:
        store.update(batch_id, status="failed", errors_json=_errors("file_not_found", f"input file "
                                                                    f"{batch.input_file_id} was deleted"))
        return BatchOutcome(batch_id, "failed")

    seen: set[str] = set()
    parsed = [p for n, raw in enumerate(files.lines(batch.input_file_id), 1)
              if (p := parse_line(raw, n, batch.endpoint, seen)) is not None]
    if len(parsed) > settings.batch_max_requests:
        store.update(batch_id, status="failed", errors_json=_errors(
            "too_many_requests", f"the input file has {len(parsed)} requests; a batch takes at most "
            f"{settings.batch_max_requests} (setting batch_max_requests): split it"))
        return BatchOutcome(batch_id, "failed")

    written = {r["line"]: r["kind"] for r in files.chunks(batch_id)}
    pending = [p for p in parsed if p.number not in written]
    counts = Counter(written.values())  # "output" and "error" lines written
    batch = store.beat(batch_id, runner, total=len(parsed), completed=counts["output"], failed=counts["error"])
    if batch is None:
        return BatchOutcome(batch_id, "held")
    batch = store.update(batch_id, only_from=("validating",), status="in_progress")
    log.info("batch %s: %d lines, %d already written, %d to answer (runner %s)", batch_id, len(parsed), len(written),
             len(pending), runner)

    if batch.status == "cancelling" or time.time() > (batch.expires_at or float("inf")):
        return _finalize(store, files, batch_id, runner, BatchOutcome(batch_id, "", skipped=len(written)))
    models = {p.model for p in pending if isinstance(p, BatchLine)}
    # No cache for a model under an experiment: the key, not the default, picks the version.
    versions = {m: registry.default_version(m) if registry.experiment(m) is None else None for m in models}
    for m, v in versions.items():
        if v and (gone := store.invalidate(m, v)):
            log.info("result cache: dropped %d answers of %s's earlier versions", gone, m)

    sent = cached = 0
    waited: list[float] = []  # seconds each line waited for the key's limits
    base = settings.router_url.removesuffix("/v1")
    # The lease is renewed between chunks too: a chunk of slow requests outlasts the stale limit.
    done, lost, revoked = threading.Event(), threading.Event(), threading.Event()

    def key_gone() -> bool:
        """Whether the batch's key was revoked meanwhile (then the batch stops, failed)."""
        if batch.owner and not revoked.is_set() and _grant(registry, batch.owner) is None:
            revoked.set()
        return revoked.is_set()

    def halted() -> bool:
        """Whether a line waiting for the key's limits should give up: the runner is stopping,
        lost the batch, or the batch is being cancelled, past its window or its key revoked."""
        b = None if done.is_set() or lost.is_set() or key_gone() else store.batch(batch_id)
        return b is None or b.status == "cancelling" or time.time() > (b.expires_at or float("inf"))

    def keep_lease() -> None:
        while not done.wait(settings.batch_stale_after_s / 4):
            if store.beat(batch_id, runner) is None:
                lost.set()
                return

    threading.Thread(target=keep_lease, name="batch-lease", daemon=True).start()
    # Twice the ceiling in threads: the pace bounds what is in flight, and a thread still handling
    # its answer must not keep the next request from being sent. The pool ends before the cache
    # writer, which then writes what the last answers queued.
    with httpx.Client(transport=router.platform_transport(), timeout=600) as client, httpx.Client() as metrics, \
            CacheWriter(store) as kept, \
            ThreadPoolExecutor(max_workers=2 * settings.batch_max_concurrency, thread_name_prefix="batch") as pool:
        # Never more in flight than the key may have: the rest would be refused at the router.
        ceiling = min(settings.batch_max_concurrency, grant.max_concurrency or settings.batch_max_concurrency)
        pace = Pace(ceiling, settings.batch_max_waiting, engine_load(registry, models, metrics),
                    settings.batch_max_live, quiet_reads=math.ceil(settings.batch_quiet_s)).start()

        def answer(line: BatchLine | LineError) -> tuple[dict | None, str]:
            """The line's chunk record and where its answer came from (cache, router or refused);
            None (``halted``) for a line still held back by the key's limits as the run stops."""
            if isinstance(line, LineError):
                return {"line": line.number, "kind": "error", "record": error_line(batch_id, line)}, "refused"
            if not grant.allows(line.model):
                return {"line": line.number, "kind": "error", "record": error_line(batch_id, LineError(
                    line.number, "model_not_allowed", f"line {line.number}: the API key {batch.owner!r} may not call "
                    f"model {line.model!r} (`modelops keys ls` shows its scope)", line.custom_id))}, "refused"
            version = versions.get(line.model)
            key = cache_key(line.model, version, line.url, line.body) if version and deterministic(
                line.url, line.body) and settings.batch_cache_mb else None
            if key and (hit := store.cached(key, touch=False)) is not None:
                kept.used(key)
                return {"line": line.number, "kind": "output", "record": output_line(
                    batch_id, line.number, line.custom_id, 200, fresh_answer(hit), "cache")}, "cache"
            with pace:
                answered = _send(client, base, line, {**router.route_headers(line.model), **as_key}, halted)
            if answered is None:
                return None, "halted"
            status, body, request, answered_by, waited_s = answered
            if status in (401, 403) and key_gone():  # refused for the revocation: not the line's fault
                return None, "halted"
            if waited_s:
                waited.append(waited_s)
            if key and status == 200 and answered_by == version:
                kept.keep(key, line.model, version, json.dumps(body, separators=(",", ":")))
            return {"line": line.number, "kind": "output" if status == 200 else "error",
                    "record": output_line(batch_id, line.number, line.custom_id, status, body, request)}, "router"

        # Every line is queued at once and the pace admits them: requests keep flowing while a
        # chunk is written (a barrier per chunk drained the engine at each chunk's tail).
        futures = [pool.submit(answer, line) for line in pending]
        try:
            for start in range(0, len(pending), chunk_lines):
                chunk = pending[start:start + chunk_lines]
                answers = [f.result() for f in futures[start:start + chunk_lines]]
                results = [(r, how) for r, how in answers if r is not None]
                if results:
                    files.put_chunk(batch_id, f"{chunk[0].number:08d}-{runner.rsplit(':', 1)[1]}",
                                    [r for r, _ in results])
                sent += sum(how == "router" for _, how in results)
                cached += sum(how == "cache" for _, how in results)
                for r, _ in results:
                    counts[r["kind"]] += 1
                if settings.batch_cache_mb:
                    store.evict(settings.batch_cache_mb << 20)
                batch = store.beat(batch_id, runner, completed=counts["output"], failed=counts["error"],
                                   cache_hits=Batch.cache_hits + sum(how == "cache" for _, how in results),
                                   concurrency=pace.limit)
                progress(counts["output"] + counts["error"], len(parsed))
                if batch is None or lost.is_set():
                    log.warning("batch %s: another runner took it over; stopping", batch_id)
                    return BatchOutcome(batch_id, "held", sent, cached, len(parsed) - len(pending))
                if batch.status == "cancelling" or time.time() > (batch.expires_at or float("inf")) or key_gone():
                    break
        finally:  # what is still queued is not sent; requests in flight finish, unwritten
            for f in futures:
                f.cancel()
            done.set()
            pace.stop()
    if waited:
        log.info("batch %s: %d line(s) waited %.0f s in all for API key %r's limits", batch_id, len(waited),
                 sum(waited), batch.owner)
    if revoked.is_set():
        log.warning("batch %s: API key %r was revoked; the batch stops, failed, with what was answered", batch_id,
                    batch.owner)
    return _finalize(store, files, batch_id, runner, BatchOutcome(batch_id, "", sent, cached,
                                                                 len(parsed) - len(pending), sum(waited),
                                                                 pace.backoffs),
                     failure=("key_revoked", f"the API key {batch.owner!r} that created this batch was revoked while "
                              "it ran; the output and error files hold what was answered before")
                     if revoked.is_set() else None)


def _key_limit_wait(r: httpx.Response) -> float | None:
    """Seconds to wait when ``r`` is the router's 429 for the key's own limits (its
    ``Retry-After``, 1 to 60), else None. A 429 that is not JSON is Envoy Gateway's local rate
    limit, the key's rpm on Kubernetes (plain text, no ``Retry-After``: waited 5 s at a time)."""
    if r.status_code != 429:
        return None
    try:
        code = r.json()["error"]["code"]
    except ValueError:
        code = None  # not JSON: the Gateway's
    except (KeyError, TypeError):
        return None
    if code is not None and code not in KEY_LIMIT_CODES:
        return None
    try:
        return min(60.0, max(1.0, float(r.headers.get("retry-after", "1" if code else "5"))))
    except ValueError:
        return 1.0


def _send(client: httpx.Client, base: str, line: BatchLine, headers: dict[str, str],
          halted: Callable[[], bool]) -> tuple[int, object, str, str, float] | None:
    """POST one line through the router, again on a busy or going instance's answer (429, 502,
    503, 504) or a lost connection, backing off 1, 2, 4 s. The router's 429 for the key's own
    limits spends no try: the line waits its ``Retry-After`` (checking ``halted`` each second)
    and goes again. Returns (status, body, the answer's request id, the version that answered,
    seconds waited for the key's limits), or None when ``halted`` ended a wait."""
    attempt, waited = 0, 0.0
    while True:
        try:
            r = client.post(base + line.url, json=line.body, headers=headers)
        except httpx.TransportError as e:
            if attempt == _TRIES - 1:
                return 502, {"error": {"message": f"the router could not be reached: {e}", "type": "server_error",
                                       "param": None, "code": "router_unreachable"}}, "", "", waited
        else:
            if (wait := _key_limit_wait(r)) is not None:
                until = time.monotonic() + wait
                while (left := until - time.monotonic()) > 0:
                    if halted():
                        return None
                    time.sleep(min(1.0, left))
                waited += wait
                continue
            if r.status_code not in _RETRIED or attempt == _TRIES - 1:
                try:
                    body = r.json()
                except ValueError:
                    body = r.text
                request = r.headers.get("x-request-id") or (body.get("id", "") if isinstance(body, dict) else "")
                return r.status_code, body, str(request), r.headers.get("x-model-version", ""), waited
        time.sleep(2 ** attempt)
        attempt += 1


def _errors(code: str, message: str) -> str:
    return json.dumps({"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]})


def _finalize(store: BatchStore, files: BatchFiles, batch_id: str, runner: str, outcome: BatchOutcome,
              failure: tuple[str, str] | None = None) -> BatchOutcome:
    """Write the output and error files from the chunks (each line's first answer, in line
    order) and end the batch: failed with ``failure`` (code, message) when given, cancelled
    when asked, expired past its window, else completed."""
    batch = store.beat(batch_id, runner)
    if batch is None:
        return replace(outcome, status="held")
    ending = "failed" if failure else "cancelled" if batch.status == "cancelling" else \
        "expired" if time.time() > (batch.expires_at or float("inf")) else "completed"
    store.update(batch_id, only_from=("in_progress", "cancelling"), status="finalizing")
    first: dict[int, dict] = {}
    for r in files.chunks(batch_id):
        first.setdefault(r["line"], r)
    ids = {}
    for kind in ("output", "error"):
        lines = [first[n]["record"] for n in sorted(first) if first[n]["kind"] == kind]
        if not lines:
            continue
        data = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in lines).encode()
        # The same id on a retried finalize: the file is written over, and recorded once.
        file_id = "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]
        files.put_file(file_id, data)
        store.record_file(file_id, batch.owner, f"{batch_id}_{kind}.jsonl", "batch_output", len(data))
        ids[kind] = file_id
    kinds = [r["kind"] for r in first.values()]
    store.update(batch_id, status=ending, output_file_id=ids.get("output"), error_file_id=ids.get("error"),
                 completed=kinds.count("output"), failed=kinds.count("error"), runner="",
                 **({"errors_json": _errors(*failure)} if failure else {}))
    log.info("batch %s %s: %d answered, %d failed (%d sent now, %d from the cache; pace came down %d time(s))",
             batch_id, ending, kinds.count("output"), kinds.count("error"), outcome.sent, outcome.cached,
             outcome.backoffs)
    return replace(outcome, status=ending)


def end_stale(store: BatchStore, files: BatchFiles, batch_id: str, stale_after_s: float) -> str | None:
    """End a batch that has nothing left to answer (past its window, or asked to cancel) and
    whose runner went silent, without a worker: take its lease as a runner would, write the
    output and error files of the lines already answered, and set it ``expired`` or
    ``cancelled``. Returns that status, or None when a live runner holds the batch or it is over.
    Called by the batch API's sweep (tasks/batch/api.py)."""
    runner = f"sweep:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    if store.claim(batch_id, runner, stale_after_s) is None:
        return None
    return _finalize(store, files, batch_id, runner, BatchOutcome(batch_id, "")).status


# Retried: a runner resumes from its written chunks, so a retry costs at most one chunk again.
@task(name="run_batch", retries=2, retry_delay_seconds=10, tags=["modelops"], cache_policy=NO_CACHE)
def run_batch_task(batch_id: str) -> BatchOutcome:
    """Prefect task around :func:`run_batch`, with a progress artifact (key: the batch id with
    ``-`` for ``_``, as Prefect's keys take)."""
    from prefect import get_run_logger
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from tasks import backends

    settings = Settings()
    registry, router = Registry(settings.registry), backends.router(settings)
    artifact = create_progress_artifact(0.0, key=batch_id.replace("_", "-").lower(),  # batch-<hex>
                                        description=f"lines of batch {batch_id} answered (%)")
    outcome = run_batch(batch_id, settings, registry, router,
                        progress=lambda done, total: update_progress_artifact(artifact, 100.0 * done / total))
    get_run_logger().info("batch %s: %s (%d sent, %d from the cache, %d written by an earlier runner; its lines "
                          "waited %.0f s in all for the API key's limits)", batch_id, outcome.status, outcome.sent,
                          outcome.cached, outcome.skipped, outcome.waited_s)
    return outcome
