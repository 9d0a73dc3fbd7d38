"""Regenerate modelops/data/*.json, the facts the image planner checks against.

    python deployments/runtime/refresh_compat_data.py VLLM_BACKEND_GIT_DIR
    python deployments/runtime/refresh_compat_data.py --symbols-only   # keep (1), redo (2)

1. triton_vllm_backend.json: for each Triton release in modelops.compat.TRITON_MATRIX, the vLLM
   imports of the official vLLM backend (github.com/triton-inference-server/vllm_backend,
   branch r<YY.MM>, every src/**/*.py; the newest branch present stands in for later releases
   and the file records which branch was read).
2. vllm_symbols.json: for every vLLM version in the matrix (and the local pin), which of those
   imports (plus our backend's) its source distribution satisfies: a trimmed
   modelops.vllm_symbols index, so `modelops image plan` works offline for these versions.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from modelops.compat import LOCAL_CPU, TRITON_MATRIX, our_backend_imports  # noqa: E402
from modelops.settings import get_settings  # noqa: E402
from modelops.vllm_symbols import imports_of_source, load_index  # noqa: E402


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def backend_imports(repo: Path, ref: str) -> list[str]:
    found: set[str] = set()
    for f in git(repo, "ls-tree", "-r", "--name-only", ref, "src").split():
        if f.endswith(".py"):
            found.update(imports_of_source(git(repo, "show", f"{ref}:{f}")))
    return sorted(found)


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
            backends[row.triton_release] = {"source": f"{ref}@{sha}", "imports": backend_imports(repo, ref)}
        (data / "triton_vllm_backend.json").write_text(json.dumps(backends, indent=1, sort_keys=True) + "\n")

    wanted = sorted({i for b in backends.values() for i in b["imports"]} | set(our_backend_imports()))
    modules = {i.partition(":")[0] for i in wanted}
    modules |= {m.rpartition(".")[0] for m in modules if "." in m}
    cache = get_settings().home / "cache" / "vllm-symbols"
    trimmed = {}
    for version in sorted({row.vllm_index for row in TRITON_MATRIX} | {LOCAL_CPU.vllm_index}):
        index = load_index(version, cache, modules=modules)
        kept = {}
        for m in sorted(modules):
            if m in index:
                names = {i.partition(":")[2] for i in wanted if i.partition(":")[0] == m} - {""}
                present = {n for n in names if n in index[m]["names"] or f"{m}.{n}" in index}
                kept[m] = {"names": sorted(present), "lazy": index[m]["lazy"]}
        trimmed[version] = {"asked": wanted, "index": kept}
        print(version, "indexed")
    (data / "vllm_symbols.json").write_text(json.dumps(trimmed, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
