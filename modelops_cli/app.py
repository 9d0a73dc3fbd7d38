"""The ``modelops`` Typer application and its command groups. Commands register on them from
their modules; :mod:`modelops_cli.main` imports every one."""

import inspect
import sys

import typer

__all__ = ["app", "cache_app", "image_app", "stack_app", "unwrap_help"]


class _App(typer.Typer):
    """The top-level app: a registry that cannot be used (a file overwritten or cut short, a disk
    that failed, another program's database, no write access) is one line on stderr and exit 2
    from whichever command met it, not a SQLAlchemy traceback."""

    def __call__(self, *args, **kwargs):
        from sqlalchemy.exc import DBAPIError

        from modelops.errors import RegistryError

        try:
            return super().__call__(*args, **kwargs)
        except (RegistryError, DBAPIError) as e:
            from modelops.registry import database_problem
            from modelops.settings import get_settings
            from modelops_cli.output import fail

            try:
                fail(str(e) if isinstance(e, RegistryError) else database_problem(get_settings().registry, e), 2)
            except typer.Exit:
                sys.exit(2)


app = _App(help="Announce model versions and serve them on vLLM + Triton.", no_args_is_help=True,
           pretty_exceptions_enable=False)
stack_app = typer.Typer(help="Start and stop the local stack (the same as `modelops up` / `modelops down`).",
                        no_args_is_help=True)
image_app = typer.Typer(help="The pinned runtime image.", no_args_is_help=True)
cache_app = typer.Typer(help="The model cache on FSx (materialized weights).", no_args_is_help=True)
app.add_typer(stack_app, name="stack", hidden=True)  # kept for scripts written before `up`/`down`
app.add_typer(image_app, name="image")
app.add_typer(cache_app, name="cache")


def _unwrapped(text: str) -> str:
    # A paragraph of prose becomes one line; one that lists (lines starting "-", "*") or asks
    # click not to rewrap ("\b") keeps its lines.
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") or any(line.lstrip().startswith(("-", "*"))
                                                      for line in p.splitlines()) else " ".join(p.split())
                       for p in paragraphs)


def unwrap_help(typer_app: typer.Typer) -> None:
    """Give every command of ``typer_app`` and its groups its docstring with each prose paragraph
    on one line: typer 0.29's rich help keeps a docstring's line breaks inside a paragraph, so
    help broke mid-sentence wherever the source wrapped ("printed as soon as" / "the run ...")."""
    for command in typer_app.registered_commands:
        doc = command.help or (inspect.getdoc(command.callback) if command.callback else None)
        if doc:
            command.help = _unwrapped(doc)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            unwrap_help(group.typer_instance)
