"""The batch path (tasks/batch/): the batch API behind the real HAProxy router, called with the
``openai`` client, files in moto's S3 server, and the runner (tasks/batch/run.py) answering
through the router from a stand-in instance of model ``m`` (the real engine's end to end is
tests/integration/test_batch_inference.py)."""

import json
import threading
import time

import httpx
import pytest

from modelops.batch_store import BatchStore
from tasks.batch.pace import Pace
from tests.conftest import StandInInstance, free_port, register_stand_in

pytestmark = pytest.mark.skipif(not __import__("shutil").which("haproxy"), reason="haproxy is not installed")


class _Path:
    """Model m served by a stand-in instance behind HAProxy, the batch API behind it (uvicorn in a
    thread, the router's instance secret required) and an ``openai`` client at the router."""

    def __init__(self, settings) -> None:
        import uvicorn
        from openai import OpenAI

        from modelops import Registry
        from modelops.tenancy import stack_secret
        from tasks.batch.api import create_app
        from tasks.batch.files import BatchFiles
        from tasks.traffic.haproxy import HAProxyRouter
        from tasks.traffic.interface import commit_routes, routes_from_registry

        self.settings, self.registry = settings, Registry(settings.registry)
        self.store, self.started = BatchStore(self.registry), []
        self.instance = StandInInstance()
        self.serve("1", self.instance)
        self.router = HAProxyRouter(settings)  # started once the API answers its health checks
        app = create_app(settings, self.store, BatchFiles(settings), start=self._start,
                         secret=stack_secret(settings.instance_secret_file),
                         router_transport=self.router.platform_transport())
        self.api = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.batch_port, log_level="warning"))
        threading.Thread(target=self.api.run, daemon=True).start()
        deadline = time.monotonic() + 30
        while not self.api.started and time.monotonic() < deadline:
            time.sleep(0.05)
        self.router.ensure_running(routes_from_registry(self.registry))
        commit_routes(self.registry, self.router)
        self.client = OpenAI(base_url=settings.router_url, api_key="unused", max_retries=0)

    def _start(self, batch_id: str) -> str:
        self.started.append(batch_id)
        return f"run-{len(self.started)}"

    def serve(self, version: str, instance: StandInInstance) -> None:
        """Make ``version`` of m the one serving (weight 100), on ``instance``."""
        register_stand_in(self.registry, version, instance.url, 100)
        for v in self.registry.versions("m"):
            self.registry.set_weights("m", {v.version: 100 if v.version == version else 0})

    def upload(self, lines: list) -> str:
        data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
        return self.client.files.create(file=("in.jsonl", data), purpose="batch").id

    def run(self, batch_id: str, **kw):
        from tasks.batch.run import run_batch

        return run_batch(batch_id, self.settings, self.registry, self.router, **kw)

    def output(self, batch) -> tuple[list[dict], list[dict]]:
        def read(file_id):
            return [json.loads(x) for x in self.client.files.content(file_id).text.splitlines()] if file_id else []

        return read(batch.output_file_id), read(batch.error_file_id)

    def close(self) -> None:
        self.api.should_exit = True
        self.router.stop()


@pytest.fixture
def path(home, monkeypatch):
    from modelops import get_settings

    monkeypatch.setenv("MODELOPS_BATCH_PORT", str(free_port()))
    p = _Path(get_settings())
    yield p
    p.close()


def _embed(i: int, text: str | None = None) -> dict:
    return {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "m", "input": text or f"text number {i}"}}


def test_the_openai_clients_batch_calls_work_through_the_router(path):
    lines = [_embed(i) for i in range(10)] + [
        "{not json",
        _embed(3),  # a repeated custom_id
        {**_embed(20), "url": "/v1/chat/completions"},
        {**_embed(21), "body": {"model": "nope", "input": "x"}},  # an unknown model: the router's 404
    ]
    file_id = path.upload(lines)
    assert path.client.files.retrieve(file_id).purpose == "batch"
    batch = path.client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h",
                                       metadata={"job": "test"})
    assert batch.status == "validating" and path.started == [batch.id]
    assert path.client.batches.retrieve(batch.id).model_extra["modelops"]["flow_run_id"] == "run-1"

    outcome = path.run(batch.id)
    assert (outcome.status, outcome.sent) == ("completed", 11)
    done = path.client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.metadata == {"job": "test"}
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (14, 10, 4)
    assert done.in_progress_at and done.completed_at and done.finalizing_at
    output, errors = path.output(done)
    assert [o["custom_id"] for o in output] == [f"e{i}" for i in range(10)]
    for i, o in enumerate(output):
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["data"][0]["embedding"] == [float(len(f"text number {i}"))]
    assert [e["error"]["code"] if e["error"] else e["response"]["status_code"] for e in errors] == \
        ["invalid_json", "duplicate_custom_id", "mismatched_endpoint", 404]
    assert [b.id for b in path.client.batches.list()] == [batch.id]
    assert {f.purpose for f in path.client.files.list()} == {"batch", "batch_output"}


def test_a_rerun_is_answered_from_the_cache_until_a_new_version_serves(path):
    chat = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], **extra}}
            for i, extra in enumerate([{"temperature": 0}] * 3 + [{}] * 2)]  # 3 greedy, 2 sampled
    file_id = path.upload(chat)

    def run_once():
        b = path.client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        path.run(b.id)
        return path.client.batches.retrieve(b.id)

    first = run_once()
    assert len(path.instance.answered) == 5 and first.model_extra["modelops"]["cache_hits"] == 0
    second = run_once()
    assert len(path.instance.answered) == 7  # only the two sampled requests went to the model again
    assert second.model_extra["modelops"]["cache_hits"] == 3
    assert [o["response"]["body"] for o in path.output(second)[0][:3]] == \
        [o["response"]["body"] for o in path.output(first)[0][:3]]  # cached answers equal the first ones
    assert [o["response"]["request_id"] for o in path.output(second)[0][:3]] == ["cache"] * 3

    v2 = StandInInstance("2")
    path.serve("2", v2)
    from tasks.traffic.interface import commit_routes
    commit_routes(path.registry, path.router)
    third = run_once()
    assert third.model_extra["modelops"]["cache_hits"] == 0 and len(v2.answered) == 5
    assert path.output(third)[0][0]["response"]["body"]["choices"][0]["message"]["content"] == "echo q0 from 2"
    assert path.store.cache_stats()["entries"] == 3  # version 1's answers were dropped


def _runner_dies_after_8_of_20(path):
    """A batch of 20 embeddings whose runner died once 8 lines were written (chunks of 4)."""
    file_id = path.upload([_embed(i) for i in range(20)])
    batch = path.client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")

    def crash(done, total):
        if done >= 8:
            raise RuntimeError("the flow run's process died")

    with pytest.raises(RuntimeError):
        path.run(batch.id, chunk_lines=4, progress=crash)
    assert path.store.batch(batch.id).completed == 8
    return batch


def test_a_crashed_runner_is_resumed_and_no_line_is_answered_twice(path):
    batch = _runner_dies_after_8_of_20(path)
    # A second runner while the first's lease is fresh stays out; once it is stale, it takes over.
    assert path.run(batch.id).status == "held"
    path.settings = path.settings.model_copy(update={"batch_stale_after_s": 0.01})
    outcome = path.run(batch.id, chunk_lines=4)
    # The lines answered but not written before the crash come back from the cache.
    assert (outcome.status, outcome.skipped, outcome.sent + outcome.cached) == ("completed", 8, 12)
    output, errors = path.output(path.client.batches.retrieve(batch.id))
    assert [o["custom_id"] for o in output] == [f"e{i}" for i in range(20)] and errors == []
    assert len({o["id"] for o in output}) == 20
    assert sorted(path.instance.answered) == sorted(f"text number {i}" for i in range(20))
    assert path.store.batch(batch.id).resumes == 1


def test_a_cancelled_batch_stops_and_keeps_what_was_answered(path):
    file_id = path.upload([_embed(i) for i in range(200)])
    batch = path.client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")

    def cancel(done, total):
        if done == 4:
            assert path.client.batches.cancel(batch.id).status == "cancelling"

    assert path.run(batch.id, chunk_lines=4, progress=cancel).status == "cancelled"
    done = path.client.batches.retrieve(batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    assert len(path.output(done)[0]) == done.request_counts.completed >= 8
    # The lines still queued were never sent, and nothing is sent once the batch ended.
    sent = len(path.instance.answered)
    time.sleep(0.5)
    assert done.request_counts.completed <= sent == len(path.instance.answered) < 200
    with pytest.raises(Exception, match="already cancelled"):
        path.client.batches.cancel(batch.id)


def test_bad_batches_are_refused_up_front_in_openais_shape(path):
    import openai

    file_id = path.upload([_embed(0)])
    bad = [
        (dict(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="48h"), 400, "completion_window"),
        (dict(input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h"), 404, "input_file_id"),
        (dict(input_file_id=file_id, endpoint="/v1/responses", completion_window="24h"), 400, "endpoint"),
        (dict(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h", metadata={"k": 1}), 400,
         "metadata"),
    ]
    for kwargs, status, param in bad:
        with pytest.raises(openai.APIStatusError) as e:
            path.client.batches.create(**kwargs)
        assert e.value.status_code == status and e.value.body["param"] == param, e.value.body
        assert param in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="purpose"):
        path.client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    too_big = b"x" * ((path.settings.router_max_body_mb << 20) + 1)
    with pytest.raises(openai.APIStatusError) as e:
        path.client.files.create(file=("big.jsonl", too_big), purpose="batch")
    assert e.value.status_code == 413 and "MODELOPS_ROUTER_MAX_BODY_MB" in e.value.body["message"]
    assert path.started == [] and path.client.batches.list().data == []


def test_an_empty_file_is_refused_and_an_input_over_the_request_limit_fails_the_batch(path):
    import openai

    with pytest.raises(openai.BadRequestError, match="empty"):
        path.upload(["", "   "])
    file_id = path.upload([_embed(i) for i in range(3)])
    batch = path.client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    path.settings = path.settings.model_copy(update={"batch_max_requests": 2})
    assert path.run(batch.id).status == "failed"
    failed = path.client.batches.retrieve(batch.id)
    assert failed.errors.data[0].code == "too_many_requests" and "batch_max_requests" in failed.errors.data[0].message
    assert path.instance.answered == []


def test_files_and_batches_are_seen_only_by_the_key_that_made_them(path):
    from modelops.tenancy import INSTANCE_SECRET_HEADER, stack_secret

    api = f"http://127.0.0.1:{path.settings.batch_port}"
    secret = {INSTANCE_SECRET_HEADER: stack_secret(path.settings.instance_secret_file)}
    assert httpx.get(f"{api}/v1/files", timeout=5).status_code == 403  # around the router: refused
    made = httpx.post(f"{api}/v1/files", headers={**secret, "x-modelops-key": "team-a"},
                      files={"file": ("a.jsonl", b'{"a":1}\n')}, data={"purpose": "batch"}, timeout=5).json()
    for key, seen in (("team-a", 200), ("team-b", 404)):
        got = httpx.get(f"{api}/v1/files/{made['id']}", headers={**secret, "x-modelops-key": key}, timeout=5)
        assert got.status_code == seen
    assert httpx.get(f"{api}/v1/files", headers={**secret, "x-modelops-key": "team-b"}, timeout=5).json()["data"] == []


@pytest.mark.parametrize("load", ["waiting", "live"])
def test_a_batch_backs_off_while_live_requests_wait_or_run_in_the_engine(path, load):
    setattr(path.instance, load, 3)  # live requests waiting in the engine, or running beside the batch
    path.settings = path.settings.model_copy(update={"batch_max_concurrency": 8})
    file_id = path.upload([_embed(i) for i in range(60)])
    batch = path.client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    assert path.run(batch.id, chunk_lines=20).status == "completed"
    assert path.instance.most_in_flight == 1 and path.store.batch(batch.id).concurrency == 1


def test_pace_halves_on_a_queue_or_live_requests_grows_when_clear_and_holds_when_blind():
    signal = [(0.0, 0.0)]  # (waiting, running + waiting) in the engines
    pace = Pace(max_concurrency=16, max_waiting=0, load=lambda: signal[0], start=2)
    pace.step()
    assert pace.limit == 16  # a clear read before any back-off: nobody to yield to
    signal[0] = (2.0, 2.0)
    for _ in range(4):
        pace.step()
    assert pace.limit == 1 and pace.backoffs == 4
    signal[0] = None
    pace.step()
    assert pace.limit == 1
    signal[0] = (0.0, 0.0)
    pace.step()
    assert pace.limit == 2  # then by one
    for _ in range(20):
        pace.step()
    assert pace.limit == 16
    with pace, pace:  # two of its own in the engines are not live traffic
        signal[0] = (0.0, 2.0)
        pace.step()
        assert pace.limit == 16
        signal[0] = (0.0, 3.0)  # one more: a live request
        pace.step()
        assert pace.limit == 8
    signal[0] = (0.0, 2.0)  # its two just ended, the gauge still counts them: not live traffic
    pace.step()
    assert pace.limit == 9


def test_pace_grows_after_a_back_off_only_once_the_signal_stayed_clear():
    """A read that falls between two requests of a live client is clear: after a back-off the
    batch waits for ``quiet_reads`` clear reads in a row before it adds a sequence."""
    signal = [(0.0, 1.0)]  # one live request in the engine
    pace = Pace(max_concurrency=16, max_waiting=0, load=lambda: signal[0], start=4, quiet_reads=3)
    pace.step()
    pace.step()
    assert pace.limit == 1
    for reads in ([0.0, 1.0, 0.0, 0.0, 1.0], [0.0, 0.0]):  # live traffic with gaps between requests
        for live in reads:
            signal[0] = (0.0, live)
            pace.step()
            assert pace.limit == 1
    pace.step()  # the third clear read in a row
    assert pace.limit == 2
    pace.step()
    assert pace.limit == 3  # then by one a read, while it stays clear
    signal[0] = (0.0, 4.0)
    pace.step()
    assert pace.limit == 1
    # Its own requests queueing (no live traffic) halve it, and it grows back at the next clear read.
    for _ in range(3):
        signal[0] = (0.0, 0.0)
        pace.step()
    assert pace.limit == 2
    with pace, pace:
        signal[0] = (1.0, 2.0)  # one of its two waits in the queue
        pace.step()
        assert pace.limit == 1
        signal[0] = (0.0, 2.0)
        pace.step()
        assert pace.limit == 2



def test_a_queue_of_its_own_brings_the_pace_to_what_the_engines_run_and_live_traffic_halves_it():
    """Without live traffic a queue is the batch's own: the engines are full at what they run,
    so the pace holds that many (halving left them half empty); live traffic still halves it."""
    signal = [(0.0, 0.0)]
    pace = Pace(max_concurrency=16, max_waiting=0, load=lambda: signal[0], start=16)
    slots = [pace.__enter__() for _ in range(16)]
    signal[0] = (4.0, 16.0)  # 12 of its 16 run, 4 wait
    pace.step()
    assert (pace.limit, pace.backoffs) == (12, 1)
    for _ in range(4):
        slots.pop().__exit__()
    signal[0] = (0.0, 12.0)
    pace.step()
    assert pace.limit == 13  # grows back at the next clear read
    signal[0] = (1.0, 12.0)  # one of its 12 waits
    pace.step()
    assert pace.limit == 11
    signal[0] = (0.0, 14.0)  # two requests not its own
    pace.step()
    assert pace.limit == 5
    for slot in slots:
        slot.__exit__()
    tolerant = Pace(max_concurrency=16, max_waiting=2, load=lambda: (5.0, 16.0), start=16)
    slots = [tolerant.__enter__() for _ in range(16)]
    tolerant.step()
    assert tolerant.limit == 13  # what runs, and the queue it may keep

def test_a_batch_whose_runner_went_silent_gets_a_new_flow_run(path):
    from tasks.batch.api import resume_stale

    file_id = path.upload([_embed(0)])
    batch = path.client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    waiting = {"run-1"}  # flow runs still to start (a busy worker)
    assert resume_stale(path.store, 60, path._start, waiting.__contains__) == []  # just made
    path.store.update(batch.id, created_at=int(time.time()) - 180)
    assert resume_stale(path.store, 60, path._start, waiting.__contains__) == []  # its run waits for a worker
    path.store.claim(batch.id, "dead-runner", 60)
    path.store.update(batch.id, heartbeat=time.time() - 120)
    assert resume_stale(path.store, 60, path._start, waiting.__contains__) == [batch.id]  # its runner went silent
    assert path.store.batch(batch.id).flow_run_id == "run-2" and path.store.batch(batch.id).runner == ""
    waiting.add("run-2")
    assert resume_stale(path.store, 60, path._start, waiting.__contains__) == []  # the new run waits its turn
    waiting.clear()  # ... and crashed before its runner began
    assert resume_stale(path.store, 60, path._start, waiting.__contains__) == [batch.id]
    assert path.run(batch.id).status == "completed" and path.store.batch(batch.id).resumes == 2
    # A batch no runner ever finishes is failed, not resumed forever.
    b2 = path.store.add_batch("", "/v1/embeddings", file_id, "24h", None)
    path.store.update(b2.id, created_at=0, resumes=5)
    resume_stale(path.store, 60, path._start, waiting.__contains__)
    assert path.store.batch(b2.id).status == "failed" and "no_runner" in path.store.batch(b2.id).errors_json
    # One that no runner ever took ends without a worker once past its window, or when cancelled.
    late, called_off = (path.store.add_batch("", "/v1/embeddings", file_id, "24h", None) for _ in range(2))
    path.store.update(late.id, created_at=0, expires_at=int(time.time()) - 1, flow_run_id="run-w")
    path.store.update(called_off.id, created_at=0, status="cancelling", flow_run_id="run-w")
    waiting.add("run-w")
    assert resume_stale(path.store, 60, path._start, waiting.__contains__) == []
    assert [(b.status, b.expired_at is not None, b.cancelled_at is not None, b.output_file_id) for b in
            map(path.store.batch, (late.id, called_off.id))] == [("expired", True, False, None),
                                                                  ("cancelled", False, True, None)]


@pytest.mark.parametrize("ending", ["expired", "cancelled"])
def test_a_begun_batch_with_nothing_left_to_answer_ends_without_a_worker(path, ending):
    """Its runner died after 8 of 20 lines; past its window (or asked to cancel) the sweep ends it
    with those 8 in its output file and starts no flow run (no worker may be up to run one)."""
    from tasks.batch.api import resume_stale
    from tasks.batch.files import BatchFiles

    batch = _runner_dies_after_8_of_20(path)
    path.store.update(batch.id, created_at=0, heartbeat=time.time() - 120,
                      **({"expires_at": int(time.time()) - 1} if ending == "expired" else {"status": "cancelling"}))
    started = list(path.started)
    assert resume_stale(path.store, 60, path._start, lambda run: False, files=BatchFiles(path.settings)) == []
    assert path.started == started
    done = path.client.batches.retrieve(batch.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == (ending, 8, 0)
    assert (done.expired_at if ending == "expired" else done.cancelled_at) is not None
    output, errors = path.output(done)
    assert [o["custom_id"] for o in output] == [f"e{i}" for i in range(8)] and errors == []
    # Ended: the next sweep leaves it alone.
    assert resume_stale(path.store, 60, path._start, lambda run: False, files=BatchFiles(path.settings)) == []
    assert path.client.batches.retrieve(batch.id).status == ending


def test_a_live_request_that_asks_is_answered_from_the_cache(path):
    from modelops.batch import LIVE_CACHE_HEADER

    url = f"{path.settings.router_url}/embeddings"
    body = {"model": "m", "input": "the same text"}

    def post(headers=None, **extra):
        return httpx.post(url, json={**body, **extra}, headers=headers or {}, timeout=10)

    ask = {LIVE_CACHE_HEADER: "use"}
    miss, hit = post(ask), post({LIVE_CACHE_HEADER: "USE"})  # its value in any case
    assert (miss.status_code, miss.headers["x-modelops-cache"], hit.headers["x-modelops-cache"]) == (200, "miss", "hit")
    assert hit.json() == miss.json() and hit.headers["x-model-version"] == "1"
    assert path.instance.answered == ["the same text"]
    assert "x-modelops-cache" not in post().headers and len(path.instance.answered) == 2  # never by default
    assert post(ask, input="another").headers["x-modelops-cache"] == "miss"
    # Never for chat, even greedy: only the paths whose answer depends on the request alone.
    chat = httpx.post(f"{path.settings.router_url}/chat/completions", headers=ask, timeout=10,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    assert chat.status_code == 200 and "x-modelops-cache" not in chat.headers
    # An unknown model is the router's 404, before any cache.
    assert post(ask, model="nope").status_code == 404
    # A new default version misses, and its answer is its own.
    v2 = StandInInstance("2")
    path.serve("2", v2)
    from tasks.traffic.interface import commit_routes
    commit_routes(path.registry, path.router)
    again = post(ask)
    assert (again.headers["x-modelops-cache"], again.headers["x-model-version"], v2.answered) == \
        ("miss", "2", ["the same text"])


def test_with_api_keys_batches_belong_to_their_key_and_lines_keep_its_scope(path):
    import openai
    from openai import OpenAI

    from modelops.tenancy import key_hash, new_key
    from tasks.traffic.interface import commit_routes

    keys = {name: new_key() for name in ("team-a", "team-b")}
    path.registry.create_key("team-a", key_hash(keys["team-a"]), ("m",))
    path.registry.create_key("team-b", key_hash(keys["team-b"]), ("other",))  # not m
    commit_routes(path.registry, path.router)  # the first key closes the router
    a, b = (OpenAI(base_url=path.settings.router_url, api_key=keys[n], max_retries=0) for n in keys)
    with pytest.raises(openai.AuthenticationError):
        path.client.files.list()  # no key

    lines = [_embed(i) for i in range(3)]
    batches = {}
    for name, client in (("team-a", a), ("team-b", b)):
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        file_id = client.files.create(file=("in.jsonl", data), purpose="batch").id
        batches[name] = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                                              completion_window="24h")
        assert path.store.batch(batches[name].id).owner == name
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(batches["team-a"].id)  # another key's batch is not there for it
    with pytest.raises(openai.NotFoundError):
        b.batches.cancel(batches["team-a"].id)
    assert [x.id for x in b.batches.list()] == [batches["team-b"].id]

    for name in keys:
        assert path.run(batches[name].id).status == "completed"
    assert a.batches.retrieve(batches["team-a"].id).request_counts.completed == 3
    done_b = b.batches.retrieve(batches["team-b"].id)
    assert (done_b.request_counts.completed, done_b.request_counts.failed) == (0, 3)
    errors = [json.loads(x) for x in b.files.content(done_b.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"model_not_allowed"}
    assert len(path.instance.answered) == 3  # team-b's lines never reached the model
    assert path.instance.keys == ["team-a"] * 3  # the owner's requests: its usage, not the platform's


def test_a_batch_waits_out_its_keys_limits_instead_of_failing_lines(path, caplog):
    from openai import OpenAI

    from modelops.tenancy import key_hash, new_key
    from tasks.traffic.interface import commit_routes

    key = new_key()
    path.registry.create_key("team-a", key_hash(key), ("m",), max_concurrency=1)
    commit_routes(path.registry, path.router)
    a = OpenAI(base_url=path.settings.router_url, api_key=key, max_retries=0)
    data = "".join(json.dumps(_embed(i)) + "\n" for i in range(6)).encode()
    batch = a.batches.create(input_file_id=a.files.create(file=("in.jsonl", data), purpose="batch").id,
                             endpoint="/v1/embeddings", completion_window="24h")
    # Over its tpm for the next 3 s: the router answers 429 token_limit_exceeded with Retry-After.
    path.registry.set_throttled({"team-a": time.time() + 3})
    commit_routes(path.registry, path.router)
    refused = httpx.post(f"{path.settings.router_url}/embeddings", json={"model": "m", "input": "x"},
                         headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 2
    assert a.batches.retrieve(batch.id).status == "validating"  # managing batches is no inference: not refused

    started = time.monotonic()
    with caplog.at_level("INFO", logger="tasks.batch.run"):
        outcome = path.run(batch.id)
    done = a.batches.retrieve(batch.id)
    assert (outcome.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 6, 0)
    assert time.monotonic() - started >= 2  # it waited for the throttle to end rather than fail lines
    assert "waited" in caplog.text and "team-a" in caplog.text and outcome.waited_s >= 2
    # Within the key's max_concurrency (1), and every request the key's.
    assert path.instance.most_in_flight == 1 and path.instance.keys == ["team-a"] * 6


def test_a_batch_whose_key_is_revoked_stops_failed_with_what_was_answered(path):
    from openai import OpenAI

    from modelops.tenancy import key_hash, new_key
    from tasks.traffic.interface import commit_routes

    key = new_key()
    path.registry.create_key("team-a", key_hash(key), ("m",))
    commit_routes(path.registry, path.router)
    a = OpenAI(base_url=path.settings.router_url, api_key=key, max_retries=0)
    data = "".join(json.dumps(_embed(i)) + "\n" for i in range(40)).encode()
    batch = a.batches.create(input_file_id=a.files.create(file=("in.jsonl", data), purpose="batch").id,
                             endpoint="/v1/embeddings", completion_window="24h")

    def revoke_after_the_first_chunk(done: int, total: int) -> None:
        if done == 4:
            path.registry.revoke_key("team-a")
            commit_routes(path.registry, path.router)

    outcome = path.run(batch.id, chunk_lines=4, progress=revoke_after_the_first_chunk)
    ended = path.store.batch(batch.id)
    assert (outcome.status, ended.status) == ("failed", "failed") and "key_revoked" in ended.errors_json
    from tasks.batch.files import BatchFiles  # the key is revoked: read the files as the platform

    output = [json.loads(x) for x in BatchFiles(path.settings).lines(ended.output_file_id)]
    assert 4 <= len(output) < 40 and all(o["response"]["status_code"] == 200 for o in output)
    assert ended.error_file_id is None  # the lines the revocation refused are no errors of theirs


def test_a_live_cache_miss_counts_for_the_callers_key_and_its_limits_once(path):
    from modelops.batch import LIVE_CACHE_HEADER
    from modelops.tenancy import key_hash, new_key
    from tasks.traffic.interface import commit_routes

    key = new_key()
    path.registry.create_key("team-a", key_hash(key), ("m",), rpm=2, max_concurrency=1)
    commit_routes(path.registry, path.router)

    def post(**extra):
        return httpx.post(f"{path.settings.router_url}/embeddings", json={"model": "m", "input": "same", **extra},
                          headers={LIVE_CACHE_HEADER: "use", "Authorization": f"Bearer {key}"}, timeout=10)

    # Files and batches calls are no inference: they do not count against the rpm.
    for _ in range(3):
        assert httpx.get(f"{path.settings.router_url}/files", headers={"Authorization": f"Bearer {key}"},
                         timeout=10).status_code == 200
    # The miss reaches the instance as team-a's request, past max_concurrency 1 although the
    # caller's own request is still in flight at the router, and counts once against the rpm.
    miss, hit, over = post(), post(), post()
    assert (miss.status_code, miss.headers["x-modelops-cache"]) == (200, "miss")
    assert (hit.status_code, hit.headers["x-modelops-cache"]) == (200, "hit")
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
    assert path.instance.keys == ["team-a"]
    # A client cannot claim another key, or skip its limits, with the platform's headers.
    forged = httpx.post(f"{path.settings.router_url}/embeddings", json={"model": "m", "input": "y"}, timeout=10,
                        headers={"Authorization": f"Bearer {key}", "x-modelops-key": "other",
                                 "x-modelops-key-checked": "1"})
    assert forged.status_code == 429  # still team-a's request, still over its rpm


def test_an_experiment_bypasses_the_live_cache_and_keeps_its_assignment(path):
    from modelops.batch import LIVE_CACHE_HEADER
    from modelops.experiments import Arm, ExperimentSpec, arm_of
    from tasks.traffic.experiment import start_experiment

    v2 = StandInInstance("2")
    path.serve("2", v2)
    spec = ExperimentSpec((Arm("1", 50), Arm("2", 50)), "header:x-user-id", "1")
    start_experiment(path.registry, path.router, "m", spec)
    for user in ("ann", "bob", "cid", "dee"):
        r = httpx.post(f"{path.settings.router_url}/embeddings", json={"model": "m", "input": "x"}, timeout=10,
                       headers={LIVE_CACHE_HEADER: "use", "X-User-Id": user})
        assert (r.headers["x-modelops-cache"], r.headers["x-model-version"]) == ("bypass", arm_of(spec, user.encode()))
    assert path.store.cache_stats()["entries"] == 0
