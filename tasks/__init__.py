"""Prefect tasks, one module per lifecycle stage.

Each module holds plain functions that do the work (tested directly) and thin ``@task``
wrappers that add retries, timeouts and a log line or artifact.
"""
