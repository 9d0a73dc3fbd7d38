"""The ``modelops`` Typer application and its command groups. Commands register on them from
their modules; :mod:`modelops_cli.main` imports every one."""

import typer

__all__ = ["app", "cache_app", "image_app", "stack_app"]

app = typer.Typer(help="Announce model versions and serve them on vLLM + Triton.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
stack_app = typer.Typer(help="Start and stop the local stack (the same as `modelops up` / `modelops down`).",
                        no_args_is_help=True)
image_app = typer.Typer(help="The pinned runtime image.", no_args_is_help=True)
cache_app = typer.Typer(help="The model cache on FSx (materialized weights).", no_args_is_help=True)
app.add_typer(stack_app, name="stack", hidden=True)  # kept for scripts written before `up`/`down`
app.add_typer(image_app, name="image")
app.add_typer(cache_app, name="cache")
