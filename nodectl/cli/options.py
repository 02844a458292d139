"""Options several commands share."""
from __future__ import annotations

import click


def _split_names(ctx, param, value: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(name.strip() for item in value for name in item.split(",") if name.strip())


def node_selection(fn):
    """--nodes N and --exclude NAME,... (SPEC §1: the first N nodes after the excluded ones)."""
    fn = click.option("--exclude", multiple=True, callback=_split_names, metavar="NAME,...",
                      help="Leave these nodes out (names or hosts).")(fn)
    return click.option("--nodes", type=click.IntRange(min=1), help="Use the first N nodes.")(fn)
