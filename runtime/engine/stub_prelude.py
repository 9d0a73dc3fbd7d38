"""What every ``model.py`` run by Triton's Python-backend stub needs before its first import.

runtime/startup.py copies this file to ``backends/python/modelops_stub_prelude.py``, beside
``triton_python_backend_utils.py``: the stub puts that folder on ``sys.path``, so a model file's
first import, ``import modelops_stub_prelude``, finds it there whatever package it came from
(our ``vllm`` backend, the python-backend and XGBoost templates, a user's own ``model.py``).

On import it:

- points ``sys.executable`` at the runtime's interpreter (``MODELOPS_RUNTIME_PYTHON``): the
  stub's is whatever python is on PATH, and vLLM spawns ``sys.executable -m ...`` (model
  architecture inspection);
- puts the runtime environment's folders first on ``sys.path`` (``MODELOPS_RUNTIME_PATH``,
  ``os.pathsep``-separated, set by runtime.startup.triton_env): the stub's embedded interpreter
  ignores PYTHONPATH;
- sets the ``C.UTF-8`` locale: the stub starts Python with the C locale, and torch's import then
  fails decoding UTF-8 (RUNTIME_NOTES.md).

Importing it again changes nothing more: a folder already on ``sys.path`` is not added twice.
"""

import locale
import os
import sys

if os.environ.get("MODELOPS_RUNTIME_PYTHON"):
    sys.executable = os.environ["MODELOPS_RUNTIME_PYTHON"]

for _folder in reversed([p for p in os.environ.get("MODELOPS_RUNTIME_PATH", "").split(os.pathsep) if p]):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

locale.setlocale(locale.LC_ALL, "C.UTF-8")
