"""The dependency rule, read from the code: CLI (modelops_cli) → flows → tasks → core (modelops).

Imports anywhere in a file count, including those inside functions (lazy imports still make the
arrow). runtime/ (the serving image) may use the core and nothing above it.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ABOVE = {  # package → the top-level packages it must never import
    "modelops": {"tasks", "flows", "prefect", "modelops_cli"},
    "runtime": {"tasks", "flows", "prefect", "modelops_cli"},
    "tasks": {"flows", "modelops_cli"},
    "flows": {"modelops_cli"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_no_module_imports_a_layer_above_it(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files
    wrong = {str(f.relative_to(REPO)): sorted(_imports(f) & ABOVE[package]) for f in files}
    assert {f: w for f, w in wrong.items() if w} == {}


def _runtime_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return out | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}


@pytest.mark.parametrize("one, other", [("frontend", "engine"), ("engine", "frontend")])
def test_the_runtimes_two_processes_share_no_code_but_the_core(one, other):
    # runtime/frontend runs in the instance's process, runtime/engine inside Triton's Python-backend
    # stub; they meet only in modelops.io_contract (runtime/__init__.py).
    files = sorted((REPO / "runtime" / one).rglob("*.py"))
    assert files
    crossing = {f.relative_to(REPO).as_posix(): sorted(m for m in _runtime_imports(f)
                                                       if m == f"runtime.{other}" or m.startswith(f"runtime.{other}."))
                for f in files}
    assert {f: m for f, m in crossing.items() if m} == {}


def test_the_cli_is_its_own_package_and_the_console_script_points_there():
    assert not (REPO / "modelops" / "cli.py").exists() and not (REPO / "modelops" / "stack.py").exists()
    assert 'modelops = "modelops_cli.main:app"' in (REPO / "pyproject.toml").read_text()



def _sources():
    for package in ("modelops", "modelops_cli", "tasks", "flows", "runtime"):
        for f in sorted((REPO / package).rglob("*.py")):
            yield f.relative_to(REPO).as_posix(), ast.parse(f.read_text(), filename=str(f))


def test_no_module_imports_another_modules_private_names():
    private = {}
    for rel, tree in _sources():
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                names = [a.name for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]
                private.setdefault(rel, []).extend(f"{n.module}.{a}" for a in names)
    assert {rel: names for rel, names in private.items() if names} == {}


def test_the_types_the_stages_hand_each_other_have_one_home():
    homes = {}
    for rel, tree in _sources():
        for n in ast.walk(tree):
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in {
                    "Package", "RuntimeImage", "check_package_runtime", "sealed_package", "atomic_dir", "replace_dir"}:
                homes.setdefault(n.name, []).append(rel)
    assert homes == {"Package": ["modelops/artifacts.py"], "RuntimeImage": ["modelops/artifacts.py"],
                     "check_package_runtime": ["modelops/artifacts.py"], "sealed_package": ["modelops/artifacts.py"],
                     "atomic_dir": ["modelops/fs.py"], "replace_dir": ["modelops/fs.py"]}


BACKENDS = {"LocalProvider", "KubernetesProvider", "HAProxyRouter", "GatewayAPIRouter"}
# Where the backends live, and the factory that chooses among them.
BACKEND_MODULES = {"tasks/backends.py", "tasks/provision/local.py", "tasks/provision/kubernetes.py",
                   "tasks/provision/__init__.py", "tasks/traffic/haproxy.py", "tasks/traffic/gateway_api.py"}


def test_flows_and_tasks_name_no_concrete_backend():
    named = {}
    for package in ("flows", "tasks"):
        for f in sorted((REPO / package).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if rel in BACKEND_MODULES:
                continue
            tree = ast.parse(f.read_text(), filename=rel)
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
            if names & BACKENDS:
                named[rel] = sorted(names & BACKENDS)
    assert named == {}


def test_the_backends_follow_the_settings():
    from modelops.settings import Settings
    from tasks import backends

    assert [type(backends.provider(Settings())).__name__, type(backends.router(Settings()))
            .__name__] == ["LocalProvider", "HAProxyRouter"]
    production = Settings(provider="kubernetes", router="gateway-api")
    assert [type(backends.provider(production)).__name__, type(backends.router(production))
            .__name__] == ["KubernetesProvider", "GatewayAPIRouter"]


def test_public_surface_is_deliberate():
    import modelops

    assert sorted(modelops.__all__) == [
        "HealthCheckError", "Manifest", "ManifestError", "MaterializeError", "ModelopsError", "PackageError",
        "ProvisionError", "Registry", "RuntimeImageError", "Settings", "TrafficError", "get_settings",
        "load_manifest", "parse_manifest",
    ]
