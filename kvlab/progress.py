"""Live progress of a long command: work done, time spent and an estimate of the time left.

The modules that do long work (measure, demo, evaluate) take a ``Report`` callback and call it
as their work advances, in units roughly proportional to time (tokens' worth of model passes), so
that rich's estimate of the time left holds; they know nothing of terminals. The CLI turns the
calls into a bar on stderr (``progress_bar``), or, where stderr is not a terminal (a log file, a
pipe), into one line per stage, so a log still shows where the run is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Report = Callable[[float, float, str], None]
"""report(done, total, what): ``done`` of ``total`` units, ``what`` the stage now running."""


def no_report(done: float, total: float, what: str) -> None:
    """The default ``Report``: nothing shown."""


@contextmanager
def progress_bar(title: str, enabled: bool = True) -> Iterator[Report]:
    """A ``Report`` shown as a transient bar on stderr (gone when the work ends, leaving the
    command's own output), with elapsed and estimated remaining time."""
    if not enabled:
        yield no_report
        return
    from rich.console import Console
    from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    console = Console(stderr=True)
    if not console.is_terminal:
        last = [""]

        def lines(done: float, total: float, what: str) -> None:
            if what != last[0]:
                last[0] = what
                print(f"… {title}: {what}", file=sys.stderr, flush=True)
        yield lines
        return
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
               TimeElapsedColumn(), TextColumn("elapsed, about"), TimeRemainingColumn(), TextColumn("left"))
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(title, total=None)

        def update(done: float, total: float, what: str) -> None:
            bar.update(task, completed=done, total=total, description=f"{title}: {what}")
        yield update
