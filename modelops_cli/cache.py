"""``modelops cache``: the model cache on FSx (pull, ls, evict, verify)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from modelops.errors import ModelopsError
from modelops.manifest import load_manifest
from modelops.registry import Registry
from modelops_cli.app import app, cache_app
from modelops_cli.output import (
    console,
    err,
    examples,
    fail,
    json_option,
    load_settings,
    print_table,
)


@cache_app.command("pull", epilog=examples("modelops cache pull deployments/models/all-minilm-l6-v2.yaml"))
def cache_pull(manifest_file: Path = typer.Argument(..., help="model manifest (YAML)")) -> None:
    """Materialize a manifest's weights onto FSx now, with a progress bar (resumable)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from tasks.materialize import materialize

    settings = load_settings()
    try:
        manifest = load_manifest(manifest_file)
    except ModelopsError as e:
        fail(str(e), 2)
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err) as bar:
        job = bar.add_task(f"{manifest.model_id} {manifest.version}", total=None)
        try:
            result = materialize(manifest, settings, progress=lambda n: bar.advance(job, n),
                                 total_callback=lambda todo: bar.update(job, total=todo))
        except ModelopsError as e:
            bar.stop()
            fail(str(e))
        except KeyboardInterrupt:
            bar.stop()
            fail(f"interrupted: what was written stays in {settings.fsx_dir / manifest.model_id}/.staging-"
                  f"{manifest.version}; `modelops cache pull {manifest_file}` again resumes from it", 130)
    if result.transferred:
        console.print(f"{result.path}: {result.files} files, {result.bytes / 1e6:.1f} MB; "
                      f"{result.transferred / 1e6:.1f} MB transferred in {result.seconds:.1f} s ({result.mb_per_s:.0f} MB/s)")
    else:
        console.print(f"{result.path}: cache hit, nothing transferred ({result.files} files, {result.bytes / 1e6:.1f} MB)")
    if settings.cache_budget_gb is not None:  # as the lifecycle's materialize task does
        from tasks.materialize import evict

        for v in evict(int(settings.cache_budget_gb * 1e9), settings, keep=(manifest.model_id, manifest.version)):
            console.print(_removed(v, f", least recently used; budget {settings.cache_budget_gb:g} GB"))


def _removed(v: dict, why: str = "") -> str:
    """One line for an entry :func:`tasks.materialize.evict` removed (``why`` follows the size)."""
    if v["leftover"]:
        return f"reclaimed {v['path']} ({v['bytes'] / 1e6:.1f} MB, abandoned staging)"
    return f"evicted {v['model_id']} {v['version']} ({v['bytes'] / 1e6:.1f} MB{why})"


@cache_app.command("ls", epilog=examples("modelops cache ls", "modelops cache ls --json"))
def cache_ls(as_json: bool = json_option("print JSON")) -> None:
    """Versions on FSx, least recently used first, with their registry state; then staging
    folders (state "pull in progress", or "abandoned staging": `cache evict` reclaims those)."""
    from datetime import datetime

    from tasks.materialize import cached_versions, leftovers, stored_bytes

    settings = load_settings()
    states = {(v.model_id, v.version): v.state for v in Registry(settings.registry).versions()}
    rows = [{**v, "path": str(v["path"]), "state": states.get((v["model_id"], v["version"]), "-")}
            for v in cached_versions(settings)]
    # Staging folders are rows too (JSON stays one list): abandoned ones `cache evict` reclaims.
    left = [{"model_id": v["model_id"], "version": v["version"], "path": str(v["path"]), "bytes": v["bytes"],
             "unique_bytes": v["bytes"], "last_used": v["last_used"],
             "state": "pull in progress" if v["in_use"] else "abandoned staging"}
            for v in leftovers(settings)]
    if as_json:
        print(json.dumps(rows + left, indent=2))
        return
    # MB: the copy's size; unique MB: what only this version holds (the rest it shares with other
    # versions of the same S3 objects, hard links to one copy: removing it frees only its unique MB).
    table = Table("model", "version", "MB", "unique MB", "shared MB", "last used", "registry state", "path")
    for r in rows + left:
        table.add_row(r["model_id"], r["version"], f"{r['bytes'] / 1e6:.1f}", f"{r['unique_bytes'] / 1e6:.1f}",
                      f"{(r['bytes'] - r['unique_bytes']) / 1e6:.1f}",
                      datetime.fromtimestamp(r["last_used"]).isoformat(timespec="seconds"), r["state"], r["path"])
    print_table(table)
    logical, stored = sum(r["bytes"] for r in rows), stored_bytes(settings)
    console.print(f"total {stored / 1e6:.1f} MB in {settings.fsx_dir}"
                  + (f" ({logical / 1e6:.1f} MB of copies: {(logical - stored) / 1e6:.1f} MB shared between versions)"
                     if logical > stored else ""))
    if abandoned := [r for r in left if r["state"] == "abandoned staging"]:
        console.print(f"{len(abandoned)} abandoned staging folder(s) hold {sum(r['bytes'] for r in abandoned) / 1e6:.1f}"
                      " MB more: a `cache pull` of that version resumes from one, `cache evict` reclaims them")


@cache_app.command("evict", epilog=examples("modelops cache evict --budget-gb 50", "modelops cache evict",
                                              "modelops cache evict all-minilm-l6-v2 1"))
def cache_evict(model_id: str = typer.Argument(None, help="with VERSION: remove this one version (not in use)"),
                version: str = typer.Argument(None, help="the version to remove"),
                budget_gb: float = typer.Option(
                    None, help="keep at most this many GB (default: setting cache_budget_gb; neither: only reclaim "
                    "abandoned staging folders)")) -> None:
    """Reclaim abandoned staging folders, then remove least recently used versions beyond the
    budget; never a version in use, never a pull in progress. With MODEL VERSION: remove that
    version only (e.g. after `cache verify` found it damaged)."""
    from tasks.materialize import evict, evict_version, stored_bytes

    settings = load_settings()
    if model_id is not None:
        if version is None:
            fail("give both MODEL and VERSION to remove one version, or neither", 2)
        try:
            gone = evict_version(model_id, version, settings)
        except ModelopsError as e:
            fail(str(e), 2)
        console.print(f"evicted {model_id} {version} ({gone['bytes'] / 1e6:.1f} MB); `modelops cache pull` fetches "
                      "it again")
        return
    budget = budget_gb if budget_gb is not None else settings.cache_budget_gb
    if budget is not None and not (0 <= budget < float("inf")):
        fail(f"--budget-gb must be a finite number ≥ 0, got {budget}", 2)
    removed = evict(int(budget * 1e9) if budget is not None else None, settings)
    for v in removed:
        console.print(_removed(v))
    if not removed:
        console.print("nothing evicted" + ("" if budget is not None else
                                           " (no budget: pass --budget-gb or set MODELOPS_CACHE_BUDGET_GB to evict "
                                           "versions too)"))
    left = stored_bytes(settings)
    if budget is not None and left > budget * 1e9:
        console.print(f"still {left / 1e9:.2f} GB cached, over the {budget} GB budget: the rest is in use "
                      "(provisioning, serving or draining)")


@cache_app.command("verify", epilog=examples("modelops cache verify all-minilm-l6-v2 1"))
def cache_verify(model_id: str = typer.Argument(..., help="model id"),
                 version: str = typer.Argument(..., help="version")) -> None:
    """Re-hash a cached copy against its completion record (sha256, S3's CRC32/CRC32C/CRC64NVME,
    ETag with its part layout, size); exit 1 naming each file that differs."""
    from tasks.materialize import verify_cached

    try:
        report = verify_cached(model_id, version, load_settings())
    except ModelopsError as e:
        fail(str(e), 2)
    for problem in report["problems"]:
        err.print(problem)
    checked = ", ".join(f"{n} by {kind}" for kind, n in sorted(report["checked"].items()))
    if report["problems"]:
        fail(f"{model_id} {version} at {report['path']}: {len(report['problems'])} of {report['files']} file(s) "
              f"differ from the record; `modelops cache evict {model_id} {version}` then `modelops cache pull` "
              "fetches it again")
    console.print(f"{model_id} {version} at {report['path']}: {report['files']} files match their record ({checked})")


if __name__ == "__main__":
    app()
