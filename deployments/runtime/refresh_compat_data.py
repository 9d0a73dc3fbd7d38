"""Regenerate modelops/data/*.json, the facts the image planner checks against.

    python deployments/runtime/refresh_compat_data.py VLLM_BACKEND_GIT_DIR
    python deployments/runtime/refresh_compat_data.py --symbols-only   # keep (1), redo (2)

1. triton_vllm_backend.json: for each Triton release in modelops.compat.TRITON_MATRIX, the vLLM
   imports of the official vLLM backend (github.com/triton-inference-server/vllm_backend,
   branch r<YY.MM>, every src/**/*.py; the newest branch present stands in for later releases
   and the file records which branch was read), and its uses of them (attributes and call
   keywords, modelops.vllm_api.uses_of_source, with file:line).
2. vllm_symbols.json: for every vLLM version in the matrix (and the local pin), which of those
   imports (plus our backend's) its source distribution satisfies: a trimmed
   modelops.vllm_symbols index, so `modelops image plan` works offline for these versions;
   and the verdict on every use ("api": {use key: null | what is missing}).
3. vllm_wheels.json: for the same versions, the torch that PyPI's x86_64 wheel requires (its
   METADATA's Requires-Dist, read through PEP 658 or by range requests into the wheel).

Reads PyPI (sdists, about 300 MB in all, cached under <home>/cache/vllm-symbols).
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from modelops.compat import LOCAL_CPU, TRITON_MATRIX, our_backend_imports, our_backend_uses  # noqa: E402
from modelops.settings import get_settings  # noqa: E402
from modelops.vllm_api import check_uses, uses_of_source  # noqa: E402
from modelops.vllm_symbols import imports_of_source, load_api, load_index, wheel_requirements  # noqa: E402


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def backend_api(repo: Path, ref: str) -> tuple[list[str], list[list]]:
    found: set[str] = set()
    uses = []
    for f in git(repo, "ls-tree", "-r", "--name-only", ref, "src").split():
        if f.endswith(".py"):
            source = git(repo, "show", f"{ref}:{f}")
            found.update(imports_of_source(source))
            uses += [f"{u.where} {u.key}" for u in uses_of_source(source, f)]
    return sorted(found), uses


def main() -> None:
    data = REPO / "modelops" / "data"
    if sys.argv[1] == "--symbols-only":  # our backend's imports changed; the official ones did not
        backends = json.loads((data / "triton_vllm_backend.json").read_text())
    else:
        repo = Path(sys.argv[1])
        branches = set(git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads").split())
        newest = max(b for b in branches if b.startswith("r2"))
        backends = {}
        for row in TRITON_MATRIX:
            ref = f"r{row.triton_release}" if f"r{row.triton_release}" in branches else newest
            sha = git(repo, "rev-parse", "--short", ref).strip()
            imports, uses = backend_api(repo, ref)
            backends[row.triton_release] = {"source": f"{ref}@{sha}", "imports": imports, "uses": uses}
        (data / "triton_vllm_backend.json").write_text(json.dumps(backends, indent=1, sort_keys=True) + "\n")

    wanted = sorted({i for b in backends.values() for i in b["imports"]} | set(our_backend_imports()))
    modules = {i.partition(":")[0] for i in wanted}
    modules |= {m.rpartition(".")[0] for m in modules if "." in m}
    cache = get_settings().home / "cache" / "vllm-symbols"
    from modelops.vllm_api import Use

    uses = {Use.parse(u) for b in backends.values() for u in b["uses"]}
    uses = {Use(u.spec, u.member, u.keyword, u.instance) for u in uses} | \
        {Use(u.spec, u.member, u.keyword, u.instance) for u in our_backend_uses()}
    trimmed, wheels = {}, {}
    for version in sorted({row.vllm_index for row in TRITON_MATRIX} | {LOCAL_CPU.vllm_index}):
        index = load_index(version, cache, modules=modules)
        kept = {}
        for m in sorted(modules):
            if m in index:
                names = {i.partition(":")[2] for i in wanted if i.partition(":")[0] == m} - {""}
                present = {n for n in names if n in index[m]["names"] or f"{m}.{n}" in index}
                kept[m] = {"names": sorted(present), "lazy": index[m]["lazy"]}
        api = load_api(version, cache, modules={u.spec.partition(":")[0] for u in uses})
        trimmed[version] = {"asked": wanted, "index": kept, "api": check_uses(sorted(uses, key=str), api)}
        wheels[version] = wheel_requirements(version, ("torch",))
        print(version, "indexed", wheels[version])
    (data / "vllm_symbols.json").write_text(json.dumps(trimmed, indent=1, sort_keys=True) + "\n")
    (data / "vllm_wheels.json").write_text(json.dumps(wheels, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
