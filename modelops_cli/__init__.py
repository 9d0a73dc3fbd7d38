"""The ``modelops`` command line (typer + rich), a layer of its own above flows, tasks and the
core ``modelops`` package: one module per command group (:mod:`~modelops_cli.models`,
:mod:`~modelops_cli.stack`, :mod:`~modelops_cli.image`, :mod:`~modelops_cli.cache`), the output
helpers (:mod:`~modelops_cli.output`), the Prefect API client side (:mod:`~modelops_cli.prefect_api`)
and the local stack's processes (:mod:`~modelops_cli.local_stack`)."""
