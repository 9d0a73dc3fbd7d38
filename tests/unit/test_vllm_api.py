"""The attribute-level probe (modelops.vllm_api) and the wheel/base fit (modelops.compat)."""

import io
import json
import tarfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelops import RuntimeImageError
from modelops.compat import (
    BASE_TORCH,
    TRITON_MATRIX,
    backend_problems,
    check_backend,
    check_wheel_fit,
    official_backend_uses,
    pin_for,
    wheel_torch,
)
from modelops.vllm_api import Use, api_index, check_uses, uses_of_source
from modelops.vllm_symbols import _names_index, imports_of_source, sdist_sources

# Two releases of a small vLLM-shaped package: 2.0 renames an engine attribute and a keyword.
_V1 = {
    "vllm/__init__.py": "",
    "vllm/engine/__init__.py": "",
    "vllm/engine/base.py": "class EngineBase:\n    def abort(self, request_id): ...\n",
    "vllm/engine/llm_engine.py": (
        "from .base import EngineBase\n"
        "class LLMEngine(EngineBase):\n"
        "    def __init__(self, config):\n        self.model_config = config\n        self.stats = {}\n"
        "    @classmethod\n    def from_engine_args(cls, args):\n        return cls(args)\n"
        "    def step(self, *, budget=None): ...\n"
    ),
    "vllm/sampling_params.py": (
        "import msgspec\n"
        "class SamplingParams(msgspec.Struct):\n    n: int = 1\n    temperature: float = 1.0\n"
    ),
}
_V2 = dict(_V1, **{
    "vllm/engine/llm_engine.py": (
        "from vllm.engine.base import EngineBase\n"
        "class LLMEngine(EngineBase):\n"
        "    def __init__(self, config):\n        self.model_config = config\n        self.statistics = {}\n"
        "    @classmethod\n    def from_engine_args(cls, args):\n        return cls(args)\n"
        "    def step(self, *, token_budget=None): ...\n"
    ),
})

BACKEND = '''\
from vllm.engine.llm_engine import LLMEngine
from vllm.sampling_params import SamplingParams


class Model:
    def initialize(self, args):
        self.engine = LLMEngine.from_engine_args(args)
        self.params = SamplingParams(n=1, temperature=0.0)

    def execute(self):
        self.engine.step(budget=8)
        self.engine.abort("r1")
        return self.engine.stats
'''


def _sdist(files: dict[str, str], version: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{path}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _cache(tmp_path, version: str, files: dict[str, str]):
    # The record load_index/load_api keep per version: a release already read, offline.
    sources = sdist_sources(_sdist(files, version))
    record = {"complete": True, "read": [], "index": _names_index(sources), "api": api_index(sources)}
    (tmp_path / f"vllm-{version}.json").write_text(json.dumps(record))
    return tmp_path


def test_a_removed_attribute_and_a_renamed_keyword_are_refused_with_file_and_line(tmp_path):
    cache = _cache(_cache(tmp_path, "1.0", _V1), "2.0", _V2)
    imports, uses = imports_of_source(BACKEND), uses_of_source(BACKEND, "backend/model.py")
    check_backend("fixture", imports, "1.0", cache, uses)  # written against 1.0: every use resolves
    missing, unresolved = backend_problems(imports, uses, "2.0", cache)
    assert missing == []  # the imports are all still there: only the uses tell
    assert unresolved == [
        "backend/model.py:11: vllm.engine.llm_engine:LLMEngine.step(kw=budget): "
        "LLMEngine.step() takes no keyword 'budget'; it has token_budget",
        "backend/model.py:13: vllm.engine.llm_engine:LLMEngine.stats: "
        "LLMEngine has no attribute 'stats'; it has statistics",
    ]
    with pytest.raises(RuntimeImageError, match=r"fixture cannot run on vLLM 2\.0.*\n  backend/model.py:11"):
        check_backend("fixture", imports, "2.0", cache, uses)


def test_uses_follow_instances_scopes_and_fallback_imports():
    source = '''\
try:
    from vllm.v1.engine import LLMEngine
except ImportError:
    from vllm.engine import LLMEngine
from vllm.config import Config


def a():
    e = LLMEngine.from_engine_args(None)
    e.step()
    with Config(x=1) as c:
        c.size
    try:
        e.optional_thing  # guarded: the backend copes when it is missing
    except AttributeError:
        pass


def b(e):
    e.not_an_engine  # a parameter: its class is not named here
    return getattr(e, "dynamic")
'''
    assert [str(u) for u in uses_of_source(source, "m.py")] == [
        "m.py:11: vllm.config:Config(kw=x)",
        "m.py:12: vllm.config:Config.size",
        "m.py:9: vllm.v1.engine:LLMEngine|vllm.engine:LLMEngine.from_engine_args",
        "m.py:10: vllm.v1.engine:LLMEngine|vllm.engine:LLMEngine.step",
    ]


def test_names_that_may_mean_something_else_are_not_followed():
    source = '''\
from vllm.entrypoints.llm import LLM
from vllm.sampling_params import SamplingParams


class A:
    def __init__(self):
        self.engine = LLM(model="m")

    def go(self):
        return self.engine.generate  # A's engine is an LLM


class B:
    def __init__(self, engine):
        self.engine = engine

    def go(self):
        return self.engine.anything  # B's engine is whatever was passed


def reassigned(req):
    p = SamplingParams(n=1)
    p = req.params
    return p.custom_field


def parameter(SamplingParams):
    return SamplingParams.whatever


def rebound():
    SamplingParams = dict
    return SamplingParams(anything=1)


def own_attribute():
    llm = LLM(model="m")
    llm.my_cache = {}
    return llm.my_cache, llm.chat
'''
    assert [str(u) for u in uses_of_source(source, "b.py")] == [
        "b.py:37: vllm.entrypoints.llm:LLM(kw=model)",
        "b.py:7: vllm.entrypoints.llm:LLM(kw=model)",
        "b.py:39: vllm.entrypoints.llm:LLM.chat",
        "b.py:10: vllm.entrypoints.llm:LLM.generate",
        "b.py:22: vllm.sampling_params:SamplingParams(kw=n)",
    ]


def test_the_package_root_resolves_through_its_lazy_map():
    # vLLM's own vllm/__init__.py: MODULE_ATTRS read by a module-level __getattr__.
    files = dict(_V1, **{"vllm/__init__.py": (
        'MODULE_ATTRS = {"SamplingParams": ".sampling_params:SamplingParams"}\n'
        "def __getattr__(name): ...\n")})
    index = api_index(sdist_sources(_sdist(files, "1.0")))
    uses = uses_of_source("from vllm import SamplingParams\nSamplingParams(n=2, best_of=3)\n", "t.py")
    assert check_uses(uses, index) == {"vllm:SamplingParams(kw=n)": None,
                                       "vllm:SamplingParams(kw=best_of)": "SamplingParams() takes no keyword 'best_of'"}


def test_fallback_import_is_judged_against_the_one_the_release_has(tmp_path):
    # 1.0 has no vllm.v1: the backend gets vllm.engine.llm_engine's LLMEngine there.
    use = Use("vllm.v1.engine.llm_engine:LLMEngine|vllm.engine.llm_engine:LLMEngine", "step", "budget", True, "m.py:1")
    index = api_index(sdist_sources(_sdist(_V1, "1.0")))
    assert check_uses([use], index) == {use.key: None}
    v1 = dict(_V2, **{"vllm/v1/__init__.py": "", "vllm/v1/engine/__init__.py": "",
                      "vllm/v1/engine/llm_engine.py": "class LLMEngine:\n    def step(self): ...\n"})
    verdict = check_uses([use], api_index(sdist_sources(_sdist(v1, "3.0"))))[use.key]
    assert verdict == "LLMEngine.step() takes no keyword 'budget'"


def test_class_shapes_bases_fields_and_open_classes():
    files = dict(_V1, **{"vllm/model.py": (
        "import torch\nfrom dataclasses import dataclass\nfrom vllm.sampling_params import SamplingParams\n"
        "class Net(torch.nn.Module):\n    pass\n"
        "class Lazy:\n    def __getattr__(self, name): ...\n"
        "@dataclass\nclass Cfg:\n    a: int = 0\n    b: str = ''\n"
        "class Greedy(SamplingParams):\n    top_k: int = 1\n"
        "def make(*, size, **extra): ...\n"
        "def fixed(size): ...\n"
    )})
    index = api_index(sdist_sources(_sdist(files, "1.0")))
    cases = {
        Use("vllm.model:Net", "anything", instance=True): None,  # torch.nn.Module: cannot tell
        Use("vllm.model:Lazy", "anything", instance=True): None,  # __getattr__: cannot tell
        Use("vllm.model:Cfg", keyword="b"): None,
        Use("vllm.model:Cfg", keyword="c"): "Cfg() takes no keyword 'c'",
        Use("vllm.model:Greedy", keyword="temperature"): None,  # a Struct field of the base
        Use("vllm.model:Greedy", keyword="top_p"): "Greedy() takes no keyword 'top_p'; it has top_k",
        Use("vllm.model:make", keyword="whatever"): None,  # **extra
        Use("vllm.model:fixed", keyword="sizes"): "fixed() takes no keyword 'sizes'; it has size",
        Use("vllm.engine.llm_engine:LLMEngine", "abort", instance=True): None,  # from the base, via `from .base`
        Use("vllm.engine.llm_engine:LLMEngine", "model_config", instance=True): None,  # set in __init__
        Use("vllm.engine.llm_engine:LLMEngine", "__name__"): None,
        Use("vllm.gone:Thing", "x"): None,  # a missing module is the import check's to report
    }
    verdicts = check_uses(list(cases), index)
    assert {u.key: v for u, v in zip(cases, verdicts.values())} == {u.key: v for u, v in cases.items()}


_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
_modules = st.lists(_names, min_size=1, max_size=3).map(lambda p: "vllm." + ".".join(p))


@given(st.lists(st.tuples(_modules, _names), min_size=1, max_size=3), st.one_of(st.just(""), _names),
       st.one_of(st.just(""), _names), st.booleans(), st.integers(1, 9999))
def test_use_text_round_trips(alternatives, member, keyword, instance, line):
    spec = "|".join(f"{m}:{n}" for m, n in alternatives)
    use = Use(spec, member, keyword, instance, f"src/model.py:{line}")
    assert Use.parse(f"{use.where} {use.key}") == use


def test_committed_uses_parse_back():
    for p in TRITON_MATRIX:
        for use in official_backend_uses(p.name):
            assert use.spec.startswith("vllm") and use.where.startswith("src/") and Use.parse(
                f"{use.where} {use.key}") == use


# -- wheel over base ---------------------------------------------------------------------------


def test_the_bundled_vllm_fits_every_row():
    for p in TRITON_MATRIX:
        assert check_wheel_fit(p, p.vllm_index) == f"vLLM {p.vllm} is the build {p.image} ships"


def test_a_wheel_for_another_torch_is_refused_naming_both():
    with pytest.raises(RuntimeImageError) as e:
        check_wheel_fit(pin_for("24.10"), "0.7.0")
    msg = str(e.value)
    assert "the wheel requires torch==2.5.1, the image has torch 2.4.0" in msg
    assert "vLLM 0.7.0 from PyPI over nvcr.io/nvidia/tritonserver:24.10-vllm-python-py3" in msg
    with pytest.raises(RuntimeImageError, match=r"requires torch==2\.13\.0, the image has torch 2\.11\.0a0\+a6c236b9fd1"):
        check_wheel_fit(pin_for("26.03"), "0.32.0")


def test_a_wheel_for_another_cuda_is_refused_and_a_fitting_one_accepted():
    with pytest.raises(RuntimeImageError, match=r"built for CUDA 12 .*the image has CUDA 13\.0\.1\.012"):
        check_wheel_fit(pin_for("25.09"), "0.11.0")
    # NVIDIA's torch 2.11.0a0 build is a pre-release of 2.11.0, which the 0.22.1 wheel requires.
    assert "requires torch==2.11.0 and CUDA 13" in check_wheel_fit(pin_for("26.03"), "0.22.1")
    with pytest.raises(RuntimeImageError, match=r"torch in nvcr.io/nvidia/tritonserver:25.05-vllm-python-py3 is not "
                                                r"recorded .*docker run --rm"):
        check_wheel_fit(pin_for("25.05"), "0.9.0")
    assert set(BASE_TORCH) == {"24.10", "24.11", "24.12", "26.03"}  # only what a public source says


def test_wheel_torch_data_covers_the_matrix():
    assert wheel_torch("0.11.0") == "==2.8.0" and wheel_torch("0.5.5") == "==2.4.0"
    assert all(wheel_torch(p.vllm_index).startswith("==2.") for p in TRITON_MATRIX)


# -- plan_image: refusals before anything is written --------------------------------------------


def test_a_refused_plan_writes_nothing_and_out_never_overwrites_tracked_files():
    import uuid

    from modelops.settings import REPO_ROOT
    from tasks.image import DEFAULT_PLAN_DIR, plan_image

    fresh = DEFAULT_PLAN_DIR / f"trial-{uuid.uuid4().hex[:8]}"  # under the ignored out/ folder
    with pytest.raises(RuntimeImageError, match="the wheel requires torch==2.5.1"):
        plan_image("24.10", "0.7.0", out_dir=fresh)
    assert not fresh.exists()
    with pytest.raises(RuntimeImageError, match="inside .git"):
        plan_image("25.09", out_dir=REPO_ROOT / ".git" / "plan")
    with pytest.raises(RuntimeImageError, match="would overwrite deployments/runtime/requirements.lock, tracked"):
        plan_image("25.09", out_dir=REPO_ROOT / "deployments" / "runtime")
    try:
        bundled = plan_image("25.09", out_dir=fresh)
        # The bundled build as `image matrix` prints it is the bundled vLLM: the same image.
        assert plan_image("25.09", " 0.10.1.1+381074ae.nv25.9.cu130 ", out_dir=fresh).tag == bundled.tag
        assert "vllm==" not in bundled.dockerfile and (fresh / "Dockerfile").read_text() == bundled.dockerfile
    finally:
        import shutil

        shutil.rmtree(fresh, ignore_errors=True)
