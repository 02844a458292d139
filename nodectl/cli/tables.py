"""Tables that read at any terminal width, 80 columns as at 200.

A column's header is never cut (`ra…`); a `whole` column (a run id, a node name, a state, a number: what a user
reads as one or copies) is never split or cut, the others fold at word boundaries; a column with nothing in any row
(GPU figures of CPU nodes) is left out. Where the whole columns cannot all stand side by side in the width, the
table goes on below in a second part that repeats the `key` columns (node, rank), as `ps` users read a wide
listing, rather than dropping or cutting columns. The frame is light (a rule under the headers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

NOTHING = ("", "-")
GAP = 3          # between columns: a space of padding each side and the divider
FOLDED = 12      # the least a folding column is given before the table goes on in a second part


@dataclass(frozen=True)
class Column:
    header: str
    justify: str = "left"
    whole: bool = False
    key: bool = False        # repeated in every part of a table too wide for the terminal (implies whole)


def plain(cell: str) -> str:
    """What a cell shows, without its markup."""
    return Text.from_markup(cell).plain


@dataclass
class WideTable:
    """A table laid out when the width is known (rich calls __rich_console__ with it)."""

    columns: list[Column]
    rows: list[list[str]]
    title: str | None

    def natural(self, i: int) -> int:
        """What column i needs to show every cell on one line."""
        return max([len(self.columns[i].header)] +
                   [len(line) for row in self.rows for line in plain(row[i]).splitlines()])

    def widths(self) -> list[int]:
        """Each column's least width: its header, and the longest line of a whole column's cells."""
        return [self.natural(i) if column.whole or column.key else
                max(len(column.header), min(self.natural(i), FOLDED)) for i, column in enumerate(self.columns)]

    def fit(self, indices: list[int], width: int) -> dict[int, int]:
        """The width of each column of one part: whole ones their own, folding ones share what is left, each up to
        what it needs (rich's own sharing cut headers and whole cells when space ran short)."""
        least = self.widths()
        sizes = {i: least[i] for i in indices}
        spare = width - sum(sizes.values()) - GAP * (len(indices) - 1)
        folding = [i for i in indices if not (self.columns[i].whole or self.columns[i].key)]
        while spare > 0 and folding:
            wanting = [i for i in folding if sizes[i] < self.natural(i)]
            if not wanting:
                break
            for i in wanting:
                if spare:
                    sizes[i] += 1
                    spare -= 1
        return sizes

    def parts(self, width: int) -> list[list[int]]:
        widths = self.widths()
        keys = [i for i, c in enumerate(self.columns) if c.key]
        parts, current = [], list(keys)
        used = sum(widths[i] + GAP for i in keys)
        for i in range(len(self.columns)):
            if i in keys:
                continue
            if used + widths[i] > width and len(current) > len(keys):
                parts.append(current)
                current, used = list(keys), sum(widths[k] + GAP for k in keys)
            current.append(i)
            used += widths[i] + GAP
        parts.append(current)
        return parts

    def table(self, indices: list[int], title: str | None, width: int) -> Table:
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                      padding=(0, 1))
        sizes = self.fit(indices, width)
        for i in indices:
            column = self.columns[i]
            table.add_column(column.header, justify=column.justify, no_wrap=column.whole or column.key,
                             overflow="fold", width=sizes[i])
        for row in self.rows:
            table.add_row(*(row[i] for i in indices))
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        parts = self.parts(options.max_width)
        for number, indices in enumerate(parts):
            yield self.table(indices, self.title if number == 0 else "(continued)", options.max_width)


def make_table(columns: Sequence[Column], rows: Sequence[Sequence[str]], title: str | None = None,
               keep: Sequence[str] = ()) -> WideTable:
    """A table of `rows` (markup strings, one per column); columns empty in every row are dropped, unless named
    in `keep`."""
    shown = [i for i, column in enumerate(columns)
             if column.header in keep or any(plain(row[i]).strip() not in NOTHING for row in rows)]
    return WideTable([columns[i] for i in shown], [[row[i] for i in shown] for row in rows], title)
