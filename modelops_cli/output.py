"""Output helpers every command shares: the consoles, ``--json``, tables, one-line errors."""

from __future__ import annotations

import json
import os

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from modelops.registry import Registry
from modelops.settings import Settings, get_settings, settings_problem

__all__ = ["complete_models", "console", "err", "examples", "fail", "json_option", "load_settings", "print_json",
           "print_table"]


# Messages carry user data (regexes, URLs): no markup parsing, and no wrapping, so URLs and
# ids stay copyable even when output is piped (rich assumes 80 columns there).
console = Console(soft_wrap=True, markup=False, highlight=False)
err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)


def examples(*lines: str) -> str:
    """An epilog for ``--help``: one example command per paragraph."""
    return "Examples:\n\n" + "\n\n".join(f"  {x}" for x in lines)


def complete_models(incomplete: str) -> list[str]:
    """Shell completion of model ids from the registry."""
    try:
        return sorted({v.model_id for v in Registry(get_settings().registry).versions()
                       if v.model_id.startswith(incomplete)})
    except Exception:
        return []


def print_json(data) -> None:
    print(json.dumps(data, indent=2, default=str))


def load_settings() -> Settings:
    """Settings, or a one-line error naming the bad environment variable."""
    try:
        return get_settings()
    except Exception as e:  # noqa: BLE001 - settings_problem tells a settings error from the rest
        if (problem := settings_problem(e)) is None:
            raise
        fail("invalid setting: " + problem, 2)
        raise  # unreachable: fail exits


def print_table(table: Table) -> None:
    """``table`` at the width ``COLUMNS`` says, else the terminal's, else (piped) 240 columns:
    rich assumes 80 there, and tables of URLs and paths need more to stay whole. A table wider
    than that is printed as one block per row, a ``column: value`` line per cell that has a
    value, so no cell is cut mid-word."""
    columns = os.environ.get("COLUMNS", "")
    out = Console(width=int(columns), soft_wrap=True, markup=False, highlight=False) if columns.isdigit() and \
        int(columns) > 0 else console if console.is_terminal else Console(width=240, soft_wrap=True)
    if Measurement.get(out, out.options.update_width(1 << 16), table).maximum <= out.width:
        out.print(table)
        return
    cells = [(str(c.header), [str(cell) for cell in c.cells]) for c in table.columns]
    for row in range(table.row_count):
        if row:
            out.print()
        for header, values in cells:
            if not values[row].strip():
                continue
            first, *more = values[row].splitlines()
            out.print(f"{header}: {first}" + "".join(f"\n{' ' * (len(header) + 2)}{line}" for line in more))


_json_mode = False  # set by --json (one command per process): fail answers scripts in JSON too


def _remember_json(value: bool) -> bool:
    global _json_mode
    _json_mode = _json_mode or bool(value)
    return value


def json_option(help: str):
    """The ``--json`` option of every command that has one."""
    return typer.Option(False, "--json", help=help, callback=_remember_json)


def fail(message: str, code: int = 1) -> None:
    """Exit ``code`` after saying what failed: on stderr, and under ``--json`` also as
    ``{"error": message, "exit_code": code}`` on stdout, so scripts always get one JSON document."""
    if _json_mode:
        print_json({"error": message, "exit_code": code})
    err.print(Text("error: ", style="bold red") + Text(message))
    raise typer.Exit(code)
