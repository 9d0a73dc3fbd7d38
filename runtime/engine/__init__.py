"""Code that runs inside Triton's Python-backend stub process, beside vLLM's engine.

``vllm_backend.py`` is the Triton backend itself (copied to ``backends/vllm/model.py`` by
runtime/startup.py); it serves KServe requests and hands the frontend's OpenAI requests to
``openai_engine`` (vLLM's own serving classes), which checks structured outputs with
``structured_outputs``. ``logits`` holds the native constraint logits processors, and
``templates`` the ``model.py`` files of python-backend packages, and ``stub_prelude`` what each
``model.py`` imports first (the stub's sys.path and locale). Nothing here is imported by the
frontend's process: the two meet in :mod:`modelops.io_contract`.
"""
