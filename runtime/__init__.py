"""What runs inside the serving image, by the process it runs in:

- ``runtime.startup``: the instance's own process. It starts tritonserver as its child, then
  serves ``runtime.frontend`` (the OpenAI API, readiness, merged metrics, shadow copies) in
  itself with uvicorn.
- ``runtime.engine``: inside Triton's Python-backend stub, the process tritonserver starts per
  model, where vLLM's engine runs: our ``vllm`` backend, vLLM's OpenAI serving layer over it, the
  structured-output checks, the constraint logits processors and the python-backend templates.
- ``runtime.probe`` and ``runtime.tabular_probe``: self-checks run once against a built image.

The two processes talk only over Triton's KServe v2 gRPC, in the tensors and error forms of
:mod:`modelops.io_contract`. Imports modelops (the contract and schemas), never tasks.
"""
