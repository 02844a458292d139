"""Options several commands share."""
from __future__ import annotations

from dataclasses import fields

import click

from nodectl import hostlist
from nodectl.errors import UsageError


def _split_names(ctx, param, value: tuple[str, ...]) -> tuple[str, ...]:
    try:
        return tuple(name for item in value for name in hostlist.expand_list(item))
    except UsageError as exc:
        raise click.BadParameter(str(exc)) from None


class NodeCount(click.ParamType):
    """--nodes: a count (the first N nodes) or names, hosts and ranges (`gpu[01-04],login`)."""
    name = "N|NAMES"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, tuple)):
            return value
        text = str(value).strip()
        if text.isdigit():
            if int(text) < 1:
                self.fail(f"must be at least 1, got {text}", param, ctx)
            return int(text)
        try:
            names = tuple(hostlist.expand_list(text))
        except UsageError as exc:
            self.fail(str(exc), param, ctx)
        if not names:
            self.fail("a node count or node names", param, ctx)
        return names


def node_selection(fn):
    """--nodes N|NAMES and --exclude NAMES (docs/REFERENCE.md §1: the first N nodes after the excluded ones; names and
    host ranges select those nodes, in node-rank order)."""
    fn = click.option("--exclude", multiple=True, callback=_split_names, metavar="NAMES",
                      help="Leave these nodes out (names, hosts or ranges like gpu[03-04]).")(fn)
    return click.option("--nodes", type=NodeCount(),
                        help="The first N nodes, or these nodes (names, hosts or ranges like gpu[01-08]).")(fn)


class Seconds(click.FloatRange):
    """A duration in seconds: a finite number in range (click's FloatRange lets `nan` and `inf` through, and a
    `nan` timeout never fires)."""
    name = "seconds"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if number != number or number in (float("inf"), float("-inf")):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return number


def declared_options(declaration):
    """A click option for each field of a dataclass whose fields carry `option(...)` metadata
    (nodectl/launch/attending.py: Attending), in the fields' order, named as the field: the option, the value the
    command hands on and the record's key are one declaration."""
    def decorate(fn):
        for f in reversed(fields(declaration)):
            spec = f.metadata["option"]
            if spec.kind == "flag":
                kind = {"is_flag": True}
            elif spec.kind == "choice":
                kind = {"type": click.Choice(spec.choices), "show_default": True}
            elif spec.kind == "count":
                kind = {"type": click.IntRange(min=0), "show_default": True}
            else:
                kind = {"type": Seconds(min=spec.low), "show_default": f.default is not None}
            fn = click.option(spec.flag, f.name, default=f.default, help=spec.help, **kind)(fn)
        return fn
    return decorate
