"""The router's LLM policies (modelops/routing.py), latency, body limit and metrics: real HAProxy
on loopback in front of small HTTP servers that say who answered."""

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelops import get_settings
from modelops.routing import Routing
from tasks.traffic.haproxy import HAProxyRouter, render_config
from tasks.traffic.interface import ModelRoute, Server

pytestmark = pytest.mark.skipif(not __import__("shutil").which("haproxy"), reason="haproxy is not installed (make haproxy)")


class Backend:
    """An instance stand-in: ``/ready`` 200, a POST answers ``{"served_by": name}`` after ``delay``
    seconds; a POST to ``/stream`` answers server-sent events: the first after ``first_s``, then
    one every ``gap_s``, unbuffered (TCP_NODELAY), as the OpenAI frontend streams tokens."""

    def __init__(self, name: str, delay: float = 0.0, first_s: float = 0.05, gap_s: float = 0.02, events: int = 8):
        backend = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                backend.connections.append(self.connection)

            def do_GET(self):
                self._json({"ready": True})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.endswith("/stream"):
                    return self._stream()
                time.sleep(1.0 if b"slow request" in body else backend.delay)
                self._json({"served_by": backend.name})

            def _json(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Model-Version", "1")
                self.end_headers()
                self.wfile.write(data)

            def _stream(self):
                import socket

                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                time.sleep(first_s)
                for i in range(events):
                    data = f"data: {i}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    time.sleep(gap_s)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def log_message(self, *a):
                pass

        self.name, self.delay, self.connections = name, delay, []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *a: None  # health checks close connections early
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_port}"

    def stop(self) -> None:
        """Die as a process does: the listener and every open connection closed."""
        import socket

        self.server.shutdown()
        self.server.server_close()
        for conn in self.connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def router(home):
    r = HAProxyRouter(get_settings())
    yield r
    r.stop()


@pytest.fixture
def backends():
    made: list[Backend] = []

    def make(n: int, **kw) -> list[Backend]:
        made.extend([Backend(f"i{len(made) + i}", **kw) for i in range(n)])
        return made[-n:]

    yield make
    for b in made:
        b.stop()


def _route(backs: list[Backend], routing: Routing | None = None, model: str = "m") -> ModelRoute:
    servers = tuple(Server(f"{model}-1-{i}", b.address, 100) for i, b in enumerate(backs))
    return ModelRoute(model, {"1": servers}, {"1": routing} if routing else {})


def _chat(client: httpx.Client, content: str, pin: bool = False, user_turn: str | None = None, **extra) -> str:
    body = {"model": "m", "messages": [{"role": "system", "content": content},
                                       *([{"role": "user", "content": user_turn}] if user_turn else [])], **extra}
    r = client.post(f"{get_settings().router_url}/chat/completions", json=body,
                    headers={"X-Model-Version": "1"} if pin else {}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["served_by"]


def _wait_up(router: HAProxyRouter, model: str = "m", servers: int = 1) -> None:
    """Until HAProxy's first health checks passed on ``servers`` servers of the weighted backend."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        up = [line for line in router._command("show stat").splitlines()
              if line.startswith(f"m_{model},") and ",UP," in line and not line.startswith(f"m_{model},BACKEND")]
        if len(up) >= servers:
            return
        time.sleep(0.05)
    raise AssertionError("servers not up")


def _raw_head(text: str) -> bytes:
    # The prompt's first 35 bytes as httpx sends them (compact JSON, UTF-8): what the key holds.
    return json.dumps(text.ljust(40, "."), ensure_ascii=False)[1:].encode()[:35]


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefixes=st.lists(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=30), min_size=40,
                        max_size=40, unique_by=_raw_head),
       suffixes=st.lists(st.text(st.characters(exclude_categories=("Cs",)), max_size=300), min_size=3, max_size=3))
def test_requests_sharing_a_prefix_meet_on_one_instance_and_keys_spread(router, backends, prefixes, suffixes):
    backs = backends(3)
    router.apply([_route(backs, Routing(prefix_bytes=64))])
    _wait_up(router, servers=3)
    with httpx.Client() as c:
        placed = {}
        for p in (p.ljust(40, ".") for p in prefixes):
            # The key is the first 64 bytes of the raw JSON of `messages` ('[{"role":"system","content":"'
            # and 35 bytes of the prompt): what follows never moves a request.
            got = {_chat(c, p + s) for s in suffixes} | {_chat(c, p + suffixes[0], pin=True)}
            assert len(got) == 1, (p, got)
            placed[p] = got.pop()
        # 40 distinct keys land on every instance (consistent hashing; 3 ** -40 odds that one is left out).
        assert set(placed.values()) == {b.name for b in backs}


def test_session_header_and_user_field_outrank_the_prompt_and_the_field_order(router, backends):
    backs = backends(4)
    router.apply([_route(backs)])
    _wait_up(router, servers=4)
    url = f"{get_settings().router_url}/chat/completions"
    with httpx.Client() as c:
        def sent(body: dict | str, **headers) -> str:
            data = body if isinstance(body, str) else json.dumps(body)
            r = c.post(url, content=data, headers={"content-type": "application/json", **headers}, timeout=10)
            assert r.status_code == 200, r.text
            return r.json()["served_by"]

        # One user across 30 different prompts: one instance; one session header likewise.
        assert len({sent({"model": "m", "user": "alice", "messages": [{"role": "user", "content": str(i)}]})
                    for i in range(30)}) == 1
        assert len({sent({"model": "m", "messages": [{"role": "user", "content": str(i)}]}, **{"X-Session-Id": "s1"})
                    for i in range(30)}) == 1
        # Keys are read wherever they are in the body: `model` after a 500 KB `messages` (sort_keys order).
        big = "x" * 500_000
        bodies = [json.dumps({"messages": [{"content": big + str(i), "role": "user"}], "model": "m"}, sort_keys=True)
                  for i in range(10)]
        assert len({sent(b) for b in bodies}) == 1
        # An empty user is none: the prompts key the requests (they spread).
        assert len({sent({"model": "m", "user": "", "messages": [{"role": "user", "content": f"{i} " * 300}]})
                    for i in range(30)}) > 1
        # A nested "user" or "messages" is not the top-level field.
        nested = {"model": "m", "metadata": {"user": "bob", "messages": "zzz"}, "messages": [{"content": "q"}]}
        assert sent(nested) == sent({"model": "m", "messages": [{"content": "q"}]})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=300),
                      st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                                   lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                                       st.sampled_from(["model", "user", "messages", "prompt", "input", "x", "\"q"]),
                                       inner, max_size=5), max_leaves=12).map(lambda v: json.dumps(v).encode())))
def test_any_body_is_answered_never_dropped(router, backends, body):
    """Affinity never crashes the router and never sends a request nowhere: whatever the body, the
    answer is the instance's (when `model` names the model) or the router's 400/404."""
    if not getattr(test_any_body_is_answered_never_dropped, "backs", None):
        test_any_body_is_answered_never_dropped.backs = backends(2)
        router.apply([_route(test_any_body_is_answered_never_dropped.backs)])
        _wait_up(router, servers=2)
    for candidate in (body, b'{"model":"m",' + body[1:] if body.startswith(b"{") else body):
        r = httpx.post(f"{get_settings().router_url}/chat/completions", content=candidate, timeout=10,
                       headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 404), (candidate, r.status_code, r.text)
        assert r.json()  # a JSON answer: the instance's, or the router's error shape


def test_load_bound_overflows_a_hot_key_and_a_dead_instance_loses_no_request(router, backends):
    backs = backends(2, delay=0.5)
    router.apply([_route(backs, Routing(load_bound=1.25))])
    _wait_up(router, servers=2)
    with ThreadPoolExecutor(8) as pool, httpx.Client(limits=httpx.Limits(max_connections=16)) as c:
        # Eight concurrent requests of one key: the bound (1.25 × the average in flight) sends the
        # overflow to the next instance on the ring instead of queueing all eight on one.
        served = list(pool.map(lambda _: _chat(c, "one hot system prompt"), range(8)))
        assert max(served.count(b.name) for b in backs) <= 6, served
        home = _chat(c, "another key")
        victim = next(b for b in backs if b.name == home)
        victim.stop()
        # Its keys move at once: the connection refused is retried on the other instance.
        after = [_chat(c, "another key") for _ in range(10)]
        assert set(after) == {b.name for b in backs if b is not victim}


def test_under_concurrency_each_prefix_keeps_one_instance_and_the_load_stays_even(router, backends):
    """24 prefixes x 4 users in a shuffled order from 8 clients, over 3 instances (the fleet
    benchmark's shape): with the default bound a prefix stays on one instance (its prefix cache
    holds it once), and no instance takes more than half of the requests."""
    import random
    from collections import Counter, defaultdict

    backs = backends(3, delay=0.05)
    router.apply([_route(backs)])
    _wait_up(router, servers=3)
    requests = [(p, u) for p in range(24) for u in range(4)] * 2
    random.Random(5).shuffle(requests)
    where, load = defaultdict(set), Counter()
    with ThreadPoolExecutor(8) as pool, httpx.Client(limits=httpx.Limits(max_connections=8)) as c:
        def send(pu):
            # The system prompt outgrows the key (1024 bytes): users of one prompt share one key.
            got = _chat(c, f"system prompt {pu[0]} " * 80, user_turn=f"user {pu[1]}")
            where[pu[0]].add(got)
            load[got] += 1

        list(pool.map(send, requests))
    # The load guard moves a key whose instance held twice its share in a burst (an instance that
    # homes 10 of the 24 keys holds 6 of 8 in flight now and then): 0 to 4 of 24 seen here, on 2
    # busy cores. Round-robin puts every prefix on all three.
    spread = {p: s for p, s in where.items() if len(s) > 1}
    assert len(spread) <= 6, spread
    assert max(load.values()) <= len(requests) / 2, load


def test_new_prompts_fill_the_instances_by_weight(router, backends):
    """A prompt no instance holds goes to the one holding the fewest keys for its weight: prompts
    split by weight exactly (the least loaded instance, all idle here, would be a coin toss)."""
    backs = backends(2)
    servers = (Server("m-1-0", backs[0].address, 200), Server("m-1-1", backs[1].address, 100))
    router.apply([ModelRoute("m", {"1": servers})])
    _wait_up(router, servers=2)
    with httpx.Client() as c:
        # 30 system prompts of four 1 KiB chunks each, one after another (no load).
        homes = [_chat(c, f"notes {p:03d} " + "lorem ipsum " * 340) for p in range(30)]
        assert (homes.count(backs[0].name), homes.count(backs[1].name)) == (20, 10), homes
        # Each prompt stays home, whatever follows it.
        assert [_chat(c, f"notes {p:03d} " + "lorem ipsum " * 340, user_turn="next") for p in range(30)] == homes


def test_a_new_prompt_skips_an_instance_above_its_share_of_the_requests_in_flight(router, backends):
    """A backlogged instance (the one the autoscaler is relieving) takes no new prompt while another
    is below its share of the requests in flight, though it holds fewer keys; its own prompts still
    go to it."""
    backs = backends(2, delay=0.4)
    router.apply([_route(backs)])
    _wait_up(router, servers=2)
    with ThreadPoolExecutor(8) as pool, httpx.Client(limits=httpx.Limits(max_connections=16)) as c:
        homes = {p: _chat(c, f"earlier user {p} asks") for p in range(10)}  # one at a time: by keys held
        on_first = [p for p, home in homes.items() if home == backs[0].name]
        assert len(on_first) == 5, homes
        # Four slow requests (1 s) of prompts the first instance holds: its backlog.
        slow = [pool.submit(_chat, c, f"earlier user {p} asks", note="slow request") for p in on_first[:4]]
        time.sleep(0.2)
        new = list(pool.map(lambda u: _chat(c, f"new user {u} asks"), range(4)))
        assert [f.result() for f in slow] == [backs[0].name] * 4
        # Holding keys alone (5 against 5, then fewer) would have sent some of these to the backlog.
        assert new == [backs[1].name] * 4, new


def test_a_conversation_follows_its_longest_prefix_when_its_system_prompt_is_on_both(router, backends):
    backs = backends(2, delay=0.5)
    router.apply([_route(backs, Routing(load_bound=1.01))])
    _wait_up(router, servers=2)
    system = "house rules " * 200  # 2.4 KiB: two whole chunks
    with ThreadPoolExecutor(4) as pool, httpx.Client(limits=httpx.Limits(max_connections=8)) as c:
        # Four at once: the bound sends the overflow to the other instance, which then holds it too.
        assert len(set(pool.map(lambda _: _chat(c, system), range(4)))) == 2
        # New conversations on it go to either (the one holding fewer keys); each one's later turns
        # (its first turn, 1.3 KiB, makes one more whole chunk) follow it, one request at a time.
        homes = set()
        for u in range(6):
            first = "question %d " % u + "about the rules " * 80
            homes.add(home := _chat(c, system, user_turn=first))
            assert {_chat(c, system, user_turn=first + f" and follow-up {t}") for t in range(3)} == {home}, u
        assert homes == {b.name for b in backs}


def test_least_request_prefers_the_idle_instance_and_round_robin_alternates(router, backends):
    backs = backends(2)
    router.apply([_route(backs, Routing(policy="least-request"))])
    _wait_up(router, servers=2)
    with ThreadPoolExecutor(1) as pool, httpx.Client() as c, httpx.Client() as c2:
        busy = pool.submit(_chat, c2, "slow request")  # takes one instance for a second
        time.sleep(0.2)
        # While it is in flight, the next four all go to the other instance.
        others = [_chat(c, str(i)) for i in range(4)]
        assert len(set(others)) == 1 and busy.result() not in others
    router.apply([_route(backs, Routing(policy="round-robin"))])
    with httpx.Client() as c:
        turns = [_chat(c, "same prompt") for _ in range(6)]
        assert turns.count(backs[0].name) == turns.count(backs[1].name) == 3


def test_a_shift_between_versions_balances_round_robin_and_pins_keep_the_policy(tmp_path):
    a, b = Server("m-1-1", "127.0.0.1:1", 30), Server("m-2-1", "127.0.0.1:2", 70)
    cfg = render_config([ModelRoute("m", {"1": (a,), "2": (b,)})], port=1, stats_socket=tmp_path / "s")
    blocks = {blk.split("\n", 1)[0]: blk for blk in cfg.split("\n\n")}
    assert "balance roundrobin" in blocks["backend m_m"]  # exact red-black shares
    assert "http-request lua.modelops_affinity 1024 200" in blocks["backend mv_m__2"]
    assert "use-server m-2-1 if { var(txn.modelops_server) -m str m-2-1 }" in blocks["backend mv_m__2"]
    single = render_config([ModelRoute("m", {"1": (a,)}, {"1": Routing(policy="least-request")})], port=1,
                           stats_socket=tmp_path / "s")
    assert "balance leastconn" in single.split("backend m_m\n", 1)[1].split("\n\n")[0]


def test_streams_pass_the_router_without_added_latency(router, backends):
    """Server-sent events through the router reach the client when the instance sends them: time
    to the first event and between events within 5 ms of the direct stream, measured in one run
    (HAProxy holds a partial response up to 200 ms unless told not to)."""
    back = backends(1, first_s=0.05, gap_s=0.02)[0]
    router.apply([_route([back])])
    _wait_up(router)

    def timings(url: str) -> tuple[list[float], list[float]]:
        first, gaps = [], []
        with httpx.Client() as c:
            for _ in range(6):
                t0 = time.perf_counter()
                with c.stream("POST", url, json={"model": "m", "prompt": "x", "stream": True}) as r:
                    last = None
                    for _chunk in r.iter_raw():
                        now = time.perf_counter()
                        if last is None:
                            first.append(now - t0)
                        else:
                            gaps.append(now - last)
                        last = now
        return first, gaps

    direct, routed = [], []
    for _ in range(2):  # interleaved, so the machine's noise hits both alike
        direct.append(timings(f"http://{back.address}/v1/stream"))
        routed.append(timings(f"{get_settings().router_url}/stream"))
    d_first, d_gap = (statistics.median(sum((t[i] for t in direct), [])) for i in (0, 1))
    r_first, r_gap = (statistics.median(sum((t[i] for t in routed), [])) for i in (0, 1))
    assert r_first - d_first < 0.005, (r_first, d_first)
    assert abs(r_gap - d_gap) < 0.005, (r_gap, d_gap)


@pytest.fixture
def one_mib_router(router, backends, monkeypatch) -> Backend:
    """The router (same home as ``router``, which stops it) taking bodies up to 1 MiB, in front
    of one instance stand-in, which is returned."""
    monkeypatch.setenv("MODELOPS_ROUTER_MAX_BODY_MB", "1")
    small = HAProxyRouter(get_settings())
    back = backends(1)[0]
    small.apply([_route([back])])
    _wait_up(small)
    return back


def test_a_body_over_the_limit_is_413_naming_the_setting(one_mib_router):
    url = f"{get_settings().router_url}/chat/completions"
    # The last byte under the limit passes, with `model` at the body's very end.
    pad = (1 << 20) - len(json.dumps({"messages": [{"content": ""}], "model": "m"}))
    ok = httpx.post(url, content=json.dumps({"messages": [{"content": "y" * pad}], "model": "m"}),
                    headers={"content-type": "application/json"}, timeout=10)
    assert ok.status_code == 200, ok.text
    over = httpx.post(url, content=json.dumps({"messages": [{"content": "y" * (pad + 1)}], "model": "m"}),
                      headers={"content-type": "application/json"}, timeout=10)
    assert over.status_code == 413 and "MODELOPS_ROUTER_MAX_BODY_MB" in over.json()["error"]["message"]
    assert over.json()["error"]["code"] == "request_too_large"
    # The same body under the limit beside 60 KB of headers: its end would not fit the buffer
    # (`model` and the keys cut off), so it is a 413 naming the headers, not a 400 about `model`.
    cut = httpx.post(url, content=json.dumps({"messages": [{"content": "y" * pad}], "model": "m"}),
                     headers={"content-type": "application/json", "x-pad": "p" * 60_000}, timeout=10)
    assert cut.status_code == 413 and "headers are too large" in cut.json()["error"]["message"], cut.text


def test_a_chunked_body_over_the_limit_is_413_too_and_kserve_paths_get_kserves_shape(one_mib_router):
    back = one_mib_router
    root = get_settings().router_url.removesuffix("/v1")

    def chunked(size: int):
        yield b'{"model":"m","prompt":"'
        for _ in range(size // 65536):
            yield b"y" * 65536
        yield b'"}'

    for size in ((1 << 20) + 1, 3 << 20):
        r = httpx.post(f"{root}/v1/completions", content=chunked(size), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", (size, r.text)
    small = httpx.post(f"{root}/v1/completions", content=chunked(1000), headers={"content-type": "application/json"},
                       timeout=10)
    assert small.status_code == 200, small.text
    kserve = httpx.post(f"{root}/v2/models/m/generate", content=b"x" * ((1 << 20) + 1), timeout=10)
    assert kserve.status_code == 413 and "MODELOPS_ROUTER_MAX_BODY_MB" in kserve.json()["error"]
    # What HAProxy answers itself is JSON in the OpenAI shape, not its HTML pages.
    back.stop()
    gone = httpx.post(f"{root}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30)
    assert gone.status_code == 503 and gone.json()["error"]["code"] == "no_instance_available", gone.text


def test_long_session_keys_cost_the_router_neither_memory_nor_time(router, backends):
    """A client that sends a unique long X-Session-Id or 1 MB `user` with every request: the router
    keys on their first 256 bytes, hashed, so its memory stays put (and the time to hash a key is
    bounded: a whole 1 MB key took 84-94 ms of Lua, under the lock every request shares)."""
    from pathlib import Path

    back = backends(1)[0]
    router.apply([_route([back])])
    _wait_up(router)

    def worker_rss() -> int:
        children = Path(f"/proc/{router.pid()}/task/{router.pid()}/children").read_text().split()
        return sum(int(line.split()[1]) for pid in children for line in Path(f"/proc/{pid}/status").read_text()
                   .splitlines() if line.startswith("VmRSS:"))

    url = f"{get_settings().router_url}/completions"

    def send(c: httpx.Client, rounds: range) -> None:
        for i in rounds:
            big = f"{i:04d}" + "k" * 1_000_000
            # 60 KB headers: what the stand-in instance's HTTP server reads (HAProxy passed 1 MB ones).
            assert c.post(url, json={"model": "m", "prompt": "x"}, headers={"X-Session-Id": big[:60_000]},
                          timeout=30).status_code == 200
            assert c.post(url, json={"model": "m", "prompt": "x", "user": big}, timeout=30).status_code == 200

    with httpx.Client() as c:
        send(c, range(20))  # buffers pooled, Lua's collector at its working size
        before = worker_rss()
        send(c, range(20, 60))
        grown_kib = worker_rss() - before
    # Keys kept whole grew it by ~1 MB a request (about 40 MB here); now it stays where it was.
    assert grown_kib < 15_000, grown_kib


def test_router_metrics_count_requests_ttfb_and_retries_per_instance(router, backends):
    from prometheus_client.parser import text_string_to_metric_families

    backs = backends(2, delay=0.03)
    router.apply([_route(backs, Routing(policy="round-robin"))])
    _wait_up(router, servers=2)
    with httpx.Client() as c:
        for i in range(6):
            _chat(c, str(i))
        _chat(c, "pinned", pin=True)
        backs[0].stop()  # its next request is refused, retried and redispatched to the other
        for i in range(4):
            _chat(c, str(i))
    text = httpx.get(get_settings().router_url.removesuffix("/v1") + "/metrics", timeout=5).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = [s for s in families["modelops_router_requests"].samples]
    assert sum(s.value for s in requests) == 11
    assert {s.labels["instance"] for s in requests} == {"m-1-0", "m-1-1"}
    assert {(s.labels["model"], s.labels["version"], s.labels["protocol"], s.labels["code"]) for s in requests} == \
        {("m", "1", "openai", "200")}
    counts = [s for s in families["modelops_router_ttfb_seconds"].samples if s.name.endswith("_count")]
    assert sum(s.value for s in counts) == 11
    slowest = [s for s in families["modelops_router_ttfb_seconds"].samples
               if s.name.endswith("_bucket") and s.labels["le"] == "0.025"]
    assert sum(s.value for s in slowest) == 0  # every answer took the backend's 30 ms
    assert {s.labels["version"] for s in families["modelops_router_retries"].samples} == {"1"}
    redispatched = {s.labels["instance"]: s.value for s in families["modelops_router_redispatches"].samples
                    if s.labels["route"] == "weighted"}
    assert redispatched["m-1-0"] >= 1
    assert httpx.get(get_settings().router_url.removesuffix("/v1") + "/metrics/haproxy", timeout=5).status_code == 200
    # What `modelops status --json` shows per instance.
    traffic = router.instance_traffic()
    assert sum(t["requests"] for t in traffic.values()) == 11 and traffic["m-1-0"]["redispatches"] >= 1
    assert all(t["errors_5xx"] == 0 and 0.025 < t["ttfb_p50_s"] <= 0.05 for t in traffic.values()), traffic


def test_grpc_calls_keep_their_session_and_spread_without_one(router, backends):
    import tritonclient.grpc as grpcclient

    from tests.unit.test_haproxy import _grpc_backend

    ready = backends(2)
    grpcs = [_grpc_backend(f"grpc-{i}") for i in range(2)]
    servers = tuple(Server(f"m-1-{i}", ready[i].address, 100, kserve_grpc=f"127.0.0.1:{grpcs[i][1]}")
                    for i in range(2))
    router.apply([ModelRoute("m", {"1": servers})])
    _wait_up(router, servers=2)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{get_settings().router_grpc_port}")
    try:
        for session in ("a", "b", "c", "d"):
            seen = {client.get_model_metadata("m", headers={"x-model-id": "m", "x-session-id": session}).platform
                    for _ in range(5)}
            assert len(seen) == 1, (session, seen)
        unkeyed = {client.get_model_metadata("m", headers={"x-model-id": "m"}).platform for _ in range(8)}
        assert unkeyed == {"grpc-0", "grpc-1"}  # least-loaded, in turn among equals
    finally:
        client.close()
        for g, _ in grpcs:
            g.stop(0)
