"""What runs inside the serving image: startup sequence, Triton's Python-based ``vllm``
backend, and the OpenAI-compatible frontend. Imports modelops (schema only), never tasks."""
