"""What a vLLM release defines, read from its source distribution without installing it.

A Triton vLLM backend imports a fixed set of vLLM modules and names; when vLLM moves or
removes one, the backend fails at model load, deep inside a GPU container. This module
answers "does vLLM X define ``module:name``?" before anything is built:

- :func:`index_sdist` parses every ``vllm/**/*.py`` of the sdist (the ``vllm-X.tar.gz`` that
  PyPI serves) with :mod:`ast` and records, per module, the names bound at module level
  (``def``, ``class``, assignments, imports, ``__all__``) and whether the module has a
  module-level ``__getattr__`` (lazy names that static analysis cannot see).
- :func:`load_index` returns that index for a version: from the cache folder, else by
  downloading the sdist from the package index (PEP 691 JSON simple API); for releases
  published as wheels only, the wheel's zip directory and the needed modules are read with
  HTTP range requests (a few hundred KiB of a 500 MB file).
- :func:`check_imports` lists the imports an index does not satisfy.

Import strings are ``"pkg.module"`` (the module must exist) or ``"pkg.module:Name"`` (it
must also bind ``Name``).
"""

from __future__ import annotations

import ast
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from modelops.errors import RuntimeImageError
from modelops.vllm_api import api_index, modules_referenced, parse_release_source

__all__ = ["Missing", "check_imports", "imports_of_source", "index_sdist", "load_api", "load_index", "sdist_sources"]

SIMPLE_INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class Missing:
    """One import a vLLM version does not satisfy.

    Attributes:
        spec: the import, ``module`` or ``module:Name``; reason: why, in words.
    """

    spec: str
    reason: str

    def __str__(self) -> str:
        return f"{self.spec}: {self.reason}"


def _bound_names(tree: ast.Module) -> tuple[set[str], bool]:
    names: set[str] = set()
    lazy = False

    def targets(node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                targets(elt)

    def visit(body: list[ast.stmt]) -> None:
        nonlocal lazy
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                lazy |= node.name == "__getattr__"
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    targets(t)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets(node.target)
            elif isinstance(node, ast.Import):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                names.update(a.asname or a.name for a in node.names if a.name != "*")
            elif isinstance(node, (ast.If, ast.Try)):
                # Names bound under `if TYPE_CHECKING:` or `try: ... except ImportError:`
                # exist in at least one branch; count them (the import may still work).
                visit(node.body)
                visit(node.orelse)
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(getattr(node, "finalbody", []))

    visit(tree.body)
    return names, lazy


def _module_name(path: str) -> str | None:
    # "vllm-0.11.2/vllm/engine/metrics.py" → "vllm.engine.metrics"
    parts = path.split("/")[1:]
    if not parts or parts[0] != "vllm" or not parts[-1].endswith(".py"):
        return None
    parts[-1] = parts[-1][:-3]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sdist_sources(data: bytes) -> dict[str, tuple[bytes, bool]]:
    """``{module: (source, is_package)}`` for every ``vllm/**/*.py`` of a vLLM sdist.

    Raises:
        RuntimeImageError: the bytes are not a gzip tar archive, or it has no ``vllm/__init__.py``.
    """
    sources: dict[str, tuple[bytes, bool]] = {}
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
    except tarfile.TarError as e:
        raise RuntimeImageError(f"not a vLLM sdist archive: {e}") from None
    with archive:
        for member in archive:
            module = _module_name(member.name) if member.isfile() else None
            if module is not None:
                source = archive.extractfile(member).read()  # type: ignore[union-attr]
                sources[module] = (source, member.name.endswith("/__init__.py"))
    if "vllm" not in sources:
        raise RuntimeImageError("archive has no vllm/__init__.py; is it a vLLM sdist?")
    return sources


def _names_index(sources: dict[str, tuple[bytes, bool]]) -> dict[str, dict]:
    index: dict[str, dict] = {}
    for module, (source, _) in sources.items():
        try:
            names, lazy = _bound_names(parse_release_source(source))
        except (SyntaxError, ValueError):
            names, lazy = set(), True
        index[module] = {"names": sorted(names), "lazy": lazy}
    return index


def index_sdist(data: bytes) -> dict[str, dict]:
    """Index a vLLM sdist.

    Args:
        data: the bytes of ``vllm-<version>.tar.gz``.

    Returns:
        ``{module: {"names": [sorted names], "lazy": bool}}`` for every module under ``vllm/``.
        A file that does not parse is indexed with no names and ``lazy: True`` (unknown).

    Raises:
        RuntimeImageError: the bytes are not a gzip tar archive.
    """
    return _names_index(sdist_sources(data))


class _HttpRangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file through HTTP range requests, so
    :mod:`zipfile` reads a 500 MB wheel's directory and a few members, not the whole file."""

    def __init__(self, client, url: str, size: int) -> None:
        self.client, self.url, self.size, self.pos = client, url, size, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: offset, io.SEEK_CUR: self.pos + offset, io.SEEK_END: self.size + offset}[whence]
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        resp = self.client.get(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        resp.raise_for_status()
        self.pos += len(resp.content)
        return resp.content


def _release_files(client, version: str, simple_index: str) -> tuple[dict | None, dict | None]:
    listing = client.get(f"{simple_index}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    listing.raise_for_status()
    files = listing.json()["files"]
    sdist = next((f for f in files if f["filename"] == f"vllm-{version}.tar.gz"), None)
    wheel = next((f for f in files if f["filename"].startswith(f"vllm-{version}-")
                  and f["filename"].endswith("x86_64.whl")), None)
    return sdist, wheel


def _index_wheel(client, wheel: dict, modules: set[str]) -> tuple[dict[str, dict], dict[str, dict], set[str]]:
    """(names index, API index, modules read) of a wheel, reading ``modules`` and then the
    modules their classes' bases and re-exports live in (a few rounds), by range requests."""
    import zipfile

    size = wheel.get("size") or int(client.head(wheel["url"]).headers["content-length"])
    with zipfile.ZipFile(_HttpRangeFile(client, wheel["url"], size)) as zf:
        files = {m: n for n in zf.namelist() if (m := _module_name("wheel/" + n)) is not None}
        sources: dict[str, tuple[bytes, bool]] = {}
        wanted = {m for m in modules if m in files}
        for _ in range(6):
            for m in sorted(wanted - set(sources)):
                sources[m] = (zf.read(files[m]), files[m].endswith("/__init__.py"))
            wanted = {m for m in modules_referenced(api_index(sources)) if m in files} - set(sources)
            if not wanted:
                break
    index = {m: {"names": [], "lazy": True} for m in files}  # not read: unknown, accepted
    index.update(_names_index(sources))
    return index, api_index(sources), set(sources)


def _fetch_index(version: str, simple_index: str, modules: set[str]) -> dict:
    """The cache record of ``version``: from the sdist when PyPI has one (every module read),
    else from the x86_64 wheel through range requests (``modules`` and what they build on)."""
    import hashlib

    import httpx

    try:
        with httpx.Client(timeout=120, follow_redirects=True) as client:
            sdist, wheel = _release_files(client, version, simple_index)
            if sdist is not None:
                resp = client.get(sdist["url"])
                resp.raise_for_status()
                expected = sdist.get("hashes", {}).get("sha256")
                if expected and hashlib.sha256(resp.content).hexdigest() != expected:
                    raise RuntimeImageError(f"{sdist['filename']} from {simple_index} does not match its sha256")
                sources = sdist_sources(resp.content)
                return {"complete": True, "read": [], "index": _names_index(sources), "api": api_index(sources)}
            if wheel is not None:
                index, api, read = _index_wheel(client, wheel, modules)
                return {"complete": False, "read": sorted(read | modules), "index": index, "api": api}
    except httpx.HTTPError as e:
        raise RuntimeImageError(f"cannot read vLLM {version} from {simple_index}: {e}") from None
    raise RuntimeImageError(f"vLLM {version} has neither an sdist nor an x86_64 wheel on {simple_index}; "
                            "check the version (a PyPI release such as 0.11.0; `modelops image matrix` lists the bundled ones)")


def _load(version: str, cache_dir: Path, simple_index: str, modules: set[str]) -> dict:
    path = cache_dir / f"vllm-{version}.json"
    if path.is_file():
        cached = json.loads(path.read_text())
        if "api" in cached and (cached["complete"] or modules <= set(cached["read"])):
            return cached
        modules |= set(cached["read"])
    record = _fetch_index(version, simple_index, modules)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, separators=(",", ":")))
    tmp.replace(path)
    return record


def load_index(version: str, cache_dir: Path, simple_index: str = SIMPLE_INDEX,
               modules: set[str] | None = None) -> dict[str, dict]:
    """The :func:`index_sdist`-shaped index of vLLM ``version``, cached in ``<cache_dir>/vllm-<v>.json``.

    Releases without an sdist on PyPI are read from their wheel by HTTP range requests; then
    only ``modules`` (and those read before) have their names; other modules count as lazy.

    Raises:
        RuntimeImageError: the version has no sdist or wheel, or the download or parse failed.
    """
    return _load(version, cache_dir, simple_index, set(modules or ()))["index"]


def load_api(version: str, cache_dir: Path, simple_index: str = SIMPLE_INDEX,
             modules: set[str] | None = None) -> dict[str, dict]:
    """The :func:`modelops.vllm_api.api_index` of vLLM ``version`` (cached with :func:`load_index`).

    Raises:
        RuntimeImageError: as :func:`load_index`.
    """
    return _load(version, cache_dir, simple_index, set(modules or ()))["api"]


def wheel_requirements(version: str, names: tuple[str, ...] = ("torch",),
                       simple_index: str = SIMPLE_INDEX) -> dict:
    """What vLLM ``version``'s x86_64 wheel on the index requires of ``names``.

    Reads the wheel's METADATA through PEP 658 (``<wheel url>.metadata``) and, where the index
    has none for that file, from the wheel itself by HTTP range requests.

    Returns:
        ``{"wheel": filename, "requires": {name: "specifier"}}``, e.g.
        ``{"wheel": "vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl", "requires": {"torch": "==2.8.0"}}``.

    Raises:
        RuntimeImageError: no x86_64 wheel, or the index cannot be read.
    """
    import zipfile
    from email.parser import Parser

    import httpx
    from packaging.requirements import Requirement

    try:
        with httpx.Client(timeout=120, follow_redirects=True) as client:
            _, wheel = _release_files(client, version, simple_index)
            if wheel is None:
                raise RuntimeImageError(f"vLLM {version} has no x86_64 wheel on {simple_index}")
            resp = client.get(wheel["url"] + ".metadata")
            if resp.status_code == 200 and resp.content:
                text = resp.text
            else:
                size = wheel.get("size") or int(client.head(wheel["url"]).headers["content-length"])
                with zipfile.ZipFile(_HttpRangeFile(client, wheel["url"], size)) as zf:
                    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
                    text = zf.read(meta).decode()
    except httpx.HTTPError as e:
        raise RuntimeImageError(f"cannot read vLLM {version}'s wheel metadata from {simple_index}: {e}") from None
    requires = {}
    for line in Parser().parsestr(text).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.name in names and (req.marker is None or req.marker.evaluate({"extra": ""})):
            requires[req.name] = str(req.specifier)
    return {"wheel": wheel["filename"], "requires": requires}


def check_imports(imports: list[str], index: dict[str, dict]) -> list[Missing]:
    """The imports in ``imports`` that ``index`` does not satisfy (empty when all resolve).

    A name is accepted when the module binds it, when it is a submodule of the module, or when
    the module has a module-level ``__getattr__`` (it may be lazy; static analysis cannot tell).
    """
    missing = []
    for spec in imports:
        module, _, name = spec.partition(":")
        entry = index.get(module)
        if entry is None:
            parent = module.rpartition(".")[0]
            missing.append(Missing(spec, f"module {module} does not exist"
                                   + (f" (package {parent} exists)" if parent in index else "")))
        elif name and name not in entry["names"] and f"{module}.{name}" not in index and not entry["lazy"]:
            missing.append(Missing(spec, f"{module} does not define {name}"))
    return missing


def imports_of_source(source: str, prefix: str = "vllm") -> list[str]:
    """The ``module`` / ``module:Name`` imports of ``prefix`` in Python ``source``, sorted.

    Imports anywhere in the file count (backends import vLLM inside functions), except those in
    a ``try`` whose handler catches ``ImportError``: those are optional.
    """
    tree = ast.parse(source)
    optional: set[int] = set()
    for node in ast.walk(tree):
        # `try: from vllm.x import Y / except ImportError:` is a feature probe, not a need.
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            optional.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                (node.module == prefix or node.module.startswith(prefix + ".")):
            found.update(f"{node.module}:{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name == prefix or a.name.startswith(prefix + "."))
    return sorted(found)


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in ("ImportError", "ModuleNotFoundError") for t in types)
