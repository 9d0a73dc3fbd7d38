"""Prefect flows: they call tasks and decide order; no I/O of their own."""
