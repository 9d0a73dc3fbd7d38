"""``modelops batch``: the operator's view of batches (OpenAI's Batch API at the router, run by
``batch-inference`` flow runs: docs/batch.md). Clients create and read batches with the API;
this shows every key's, with what the API's object adds: cache hits, resumes, concurrency."""

from __future__ import annotations

from datetime import UTC, datetime

import typer
from rich.table import Table

from modelops.batch import TERMINAL
from modelops.batch_store import BatchStore
from modelops.registry import Registry
from modelops_cli.app import app
from modelops_cli.output import console, examples, fail, json_option, load_settings, print_json, print_table

batch_app = typer.Typer(help="Batches of OpenAI's Batch API (/v1/batches at the router): status and cancel.",
                        no_args_is_help=True)
app.add_typer(batch_app, name="batch")


def _when(t: int | None) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


@batch_app.command("status", epilog=examples("modelops batch status", "modelops batch status batch_0123abcd --json"))
def batch_status(batch_id: str | None = typer.Argument(None, help="one batch; default: every batch, newest first"),
                 as_json: bool = json_option("print OpenAI's batch objects as JSON")) -> None:
    """Show batches: status, lines done of all, failed, answers from the cache, resumes (runs
    that took over from a silent one), concurrency now, owner key and flow run."""
    store = BatchStore(Registry(load_settings().registry))
    if batch_id is not None:
        one = store.batch(batch_id)
        if one is None:
            fail(f"no batch {batch_id!r}; `modelops batch status` lists them", 2)
        batches = [one]
    else:
        batches = store.batches()
    if as_json:
        rows = [{**b.to_openai(), "owner": b.owner or None} for b in batches]
        print_json(rows[0] if batch_id is not None else rows)
        return
    if not batches:
        console.print("no batches (clients create them at the router: POST /v1/batches, docs/batch.md)")
        return
    table = Table("batch", "status", "endpoint", "done", "failed", "from cache", "resumes", "concurrency", "owner",
                  "created", "flow run")
    for b in batches:
        done = b.completed + b.failed
        table.add_row(b.id, b.status, b.endpoint, f"{done}/{b.total}" if b.total else "-", str(b.failed),
                      str(b.cache_hits), str(b.resumes), str(b.concurrency or "-"), b.owner or "-",
                      _when(b.created_at), b.flow_run_id or "-")
    print_table(table)


@batch_app.command("cancel", epilog=examples("modelops batch cancel batch_0123abcd"))
def batch_cancel(batch_id: str = typer.Argument(..., help="the batch"),
                 as_json: bool = json_option("print the batch object")) -> None:
    """Cancel a batch (any key's): its runner stops after the chunk under way and writes what
    was answered; the batch ends ``cancelled``."""
    store = BatchStore(Registry(load_settings().registry))
    b = store.batch(batch_id)
    if b is None:
        fail(f"no batch {batch_id!r}; `modelops batch status` lists them", 2)
    b = store.update(batch_id, only_from=("validating", "in_progress"), status="cancelling")
    if b.status in TERMINAL:
        fail(f"batch {batch_id} is already {b.status}", 1)
    if as_json:
        print_json(b.to_openai())
        return
    console.print(f"batch {batch_id}: cancelling; its runner stops after the chunk under way")
