"""OpenAI-compatible HTTP frontend in front of Triton (KServe v2 over gRPC)."""
