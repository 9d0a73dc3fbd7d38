"""The ``modelops`` console script: the Typer app with every command group registered.

The CLI is the top of the dependency graph (CLI → flows → tasks → core): commands that run
flows or talk to Prefect import them lazily, so ``modelops status`` stays fast.
"""

# Each module registers its commands on the app.
from modelops_cli import batch, cache, experiment, image, keys, models, regions, shadow, stack  # noqa: F401
from modelops_cli.app import app, unwrap_help
from modelops_cli.prefect_api import prefect_target

__all__ = ["app"]

app.callback()(prefect_target)  # before every command: which Prefect server it talks to
unwrap_help(app)
