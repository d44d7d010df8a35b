"""Benchmark output: rich tables on the terminal (with a progress bar) or Markdown tables.

Invariant: every measurement a benchmark takes reaches the output as one row of
one titled table; nothing is printed elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.progress import Progress
from rich.table import Table


class Report:
    """Collects titled tables; shows progress while measuring."""

    def __init__(self, *, markdown: bool = False, console: Console | None = None) -> None:
        self._markdown = markdown
        self._console = console or Console(stderr=False, width=160)
        self._progress: Progress | None = None
        self._task: int | None = None
        self._tables: list[tuple[str, list[str], list[list[str]]]] = []

    def start(self, *, total: int, description: str) -> None:
        """Begin a progress bar of ``total`` steps (drawn on stderr)."""
        self._progress = Progress(console=Console(stderr=True), transient=True)
        self._progress.start()
        self._task = self._progress.add_task(description, total=total)

    def advance(self) -> None:
        """Mark one step of progress done."""
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task)

    def table(self, title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        """Record one table."""
        self._tables.append((title, list(header), [list(r) for r in rows]))

    def finish(self) -> None:
        """Stop the progress bar and print every table."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        for title, header, rows in self._tables:
            if self._markdown:
                print(f"\n**{title}**\n")
                print("| " + " | ".join(header) + " |")
                print("|" + "|".join("---" for _ in header) + "|")
                for row in rows:
                    print("| " + " | ".join(row) + " |")
            else:
                table = Table(title=title, title_justify="left")
                for name in header:
                    table.add_column(name)
                for row in rows:
                    table.add_row(*row)
                self._console.print(table)
        self._tables.clear()
