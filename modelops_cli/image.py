"""``modelops image``: the compatibility matrix, production image plans, the local runtime build."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.table import Table

from modelops.errors import ModelopsError
from modelops_cli.app import image_app
from modelops_cli.output import (
    console,
    examples,
    fail,
    json_option,
    print_table,
)


@image_app.command("plan", epilog=examples("modelops image plan --triton-release 26.07",
                                            "modelops image plan --triton-release 25.09 --vllm 0.11.2   (refused)",
                                            "modelops image plan --triton-release local-cpu --json"))
def image_plan(
    triton_release: str = typer.Option(None, "--triton-release", help="NGC release YY.MM (default: the production "
                                       "pin); 'local-cpu' shows the local row"),
    vllm: str = typer.Option(None, "--vllm", help="run this vLLM release instead of the one the image bundles"),
    out: Path = typer.Option(None, "--out", help="folder inside the repository for Dockerfile and requirements.lock "
                             "(default deployments/runtime/ngc/out)"),
    as_json: bool = json_option("print JSON"),
) -> None:
    """Plan a production runtime image and probe it before anything is built.

    Checks the vLLM modules and names that Triton's official vLLM backend of that release and
    our backend import against the vLLM release's source; prints the Dockerfile, the lock and
    the content-derived image tag. Exit 1 when a check fails.
    """
    from modelops.compat import LOCAL_CPU, PRODUCTION

    release = PRODUCTION.name if triton_release is None else triton_release
    try:
        if release == LOCAL_CPU.name:
            if vllm:
                fail(f"--vllm {vllm}: local-cpu is pinned to vLLM {LOCAL_CPU.vllm} by its lock file; "
                      "--vllm applies to NGC releases only", 2)
            _print_local_plan(as_json)
            return
        from tasks.image import DEFAULT_PLAN_DIR, plan_image

        out = out or DEFAULT_PLAN_DIR
        plan = plan_image(release, vllm, out_dir=out)
    except ModelopsError as e:
        fail(str(e))
    if as_json:
        console.print(json.dumps({"release": plan.pin.name, "image": plan.pin.image, "tag": plan.tag,
                                  "vllm": plan.vllm, "bundled_vllm": plan.pin.vllm,
                                  "dockerfile_path": str(out / "Dockerfile"), "checks": plan.checks,
                                  "warnings": plan.warnings,
                                  "dockerfile": plan.dockerfile, "lock": plan.lock}, indent=1))
        return
    pin = plan.pin
    bundled = plan.vllm == pin.vllm_index
    console.print(f"Triton {pin.triton_release} (tritonserver {pin.tritonserver}, Python {pin.python}, CUDA {pin.cuda})"
                  f" with vLLM {pin.vllm if bundled else plan.vllm}"
                  + (f" (checked against the PyPI source of {plan.vllm})" if bundled and pin.vllm_public != plan.vllm
                     else "" if bundled else f" (bundled: {pin.vllm})"))
    for line in plan.checks:
        console.print(f"  ok   {line}")
    for line in plan.warnings:
        console.print(f"  note {line}")
    console.print(f"tag: {plan.tag}")
    console.print(f"--- Dockerfile ({out / 'Dockerfile'})")
    console.print(plan.dockerfile.rstrip())
    console.print(f"--- requirements.lock ({out / 'requirements.lock'})")
    console.print(plan.lock.rstrip())


def _print_local_plan(as_json: bool) -> None:
    from modelops.compat import LOCAL_CPU
    from tasks.image import LOCK_FILE, lock_hash

    info = {"release": LOCAL_CPU.name, "tritonserver": LOCAL_CPU.tritonserver, "triton_release": LOCAL_CPU.triton_release,
            "vllm": LOCAL_CPU.vllm, "python": LOCAL_CPU.python, "source": LOCAL_CPU.image,
            "lock": str(LOCK_FILE), "lock_hash": lock_hash(),
            "torch": LOCAL_CPU.packages.get("torch", ""), "tritonclient": LOCAL_CPU.packages.get("tritonclient", "")}
    if as_json:
        console.print(json.dumps(info, indent=1))
        return
    console.print(f"local-cpu: tritonserver {info['tritonserver']} (Triton {info['triton_release']}) + vLLM "
                  f"{info['vllm']} (CPU), torch {info['torch']}, Python {info['python']}")
    console.print(f"  from {info['source']}")
    console.print(f"  lock {info['lock']} (hash {info['lock_hash']}); built as a virtual environment by "
                  "`modelops image build`, probed after the build")


@image_app.command("matrix", epilog=examples("modelops image matrix", "modelops image matrix --json"))
def image_matrix(as_json: bool = json_option("print JSON")) -> None:
    """The Triton/vLLM compatibility matrix modelops knows (Triton's published table)."""
    from modelops.compat import BASE_TORCH, LOCAL_CPU, TRITON_MATRIX

    rows = [*TRITON_MATRIX, LOCAL_CPU]
    # The image's torch where a source records it (modelops.compat.BASE_TORCH), the lock's locally.
    torch = {p.name: BASE_TORCH.get(p.name, ("",))[0] for p in TRITON_MATRIX} | {
        LOCAL_CPU.name: LOCAL_CPU.packages.get("torch", "")}
    if as_json:
        console.print(json.dumps([{**{k: getattr(p, k) for k in ("name", "triton_release", "tritonserver", "vllm",
                                                                   "python", "cuda", "image")},
                                   "torch": torch[p.name] or None} for p in rows], indent=1))
        return
    table = Table("release", "tritonserver", "vLLM", "torch", "Python", "CUDA", "image")
    for p in rows:
        table.add_row(p.name, p.tritonserver, p.vllm, torch[p.name] or "?", p.python, p.cuda or "-", p.image)
    print_table(table)


@image_app.command("build", epilog=examples("modelops image build"))
def image_build() -> None:
    """Build (or reuse) the local runtime environment from the pinned lock, then probe it."""
    from tasks.image import build_runtime_image

    t0 = time.monotonic()
    try:
        image = build_runtime_image()
    except ModelopsError as e:
        fail(str(e))
    console.print(f"runtime {image.lock_hash} ready at {image.path} (vLLM {image.vllm}, tritonserver "
                  f"{image.pin.tritonserver}, Triton {image.pin.triton_release}) in {time.monotonic() - t0:.0f} s")
