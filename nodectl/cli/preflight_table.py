"""Preflight output for people: a nodes x checks table, each failure with its hint, and an env: block."""
from __future__ import annotations

import textwrap
import time

import yaml
from rich.markup import escape

from nodectl.preflight.verdict import FAIL, PASS, SKIP, WARN
from nodectl.preflight.run import PreflightReport
from nodectl.cli.tables import Column, make_table

STYLE = {PASS: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def print_report(console, report: PreflightReport, full: bool = False) -> None:
    """Problems first, one line each with its node and fix, in a table that fits 80 columns whatever the number
    of checks (a GPU node has about 30); the nodes x checks matrix only with `full` (preflight --all)."""
    per_node = [r for r in report.results if r.node != "cluster"]
    if full:
        _print_matrix(console, report, per_node)
    else:
        rows = []
        for node in report.nodes:
            mine = [r for r in per_node if r.node == node]
            counts = {v: sum(1 for r in mine if r.verdict == v) for v in (PASS, WARN, FAIL, SKIP)}
            problems = [f"[{STYLE[r.verdict]}]{escape(r.check)}[/]" for r in mine if r.verdict in (FAIL, WARN)]
            rows.append([escape(node), *(f"[{STYLE[v]}]{counts[v]}[/]" if counts[v] else "0"
                                         for v in (PASS, WARN, FAIL, SKIP)),
                         ", ".join(problems) or ("[red]unreachable[/]" if node in report.unreachable else "-")])
        columns = [Column("node", key=True), *(Column(v, "right", whole=True) for v in ("pass", "warn", "fail", "skip")),
                   Column("problems")]
        console.print(make_table(columns, rows, title="preflight", keep=[c.header for c in columns]))
    cluster = [r for r in report.results if r.node == "cluster"]
    if cluster and not full:
        bad = [r for r in cluster if r.verdict in (FAIL, WARN)]
        console.print(f"across nodes: {len(cluster) - len(bad)} of {len(cluster)} checks agree"
                      + (" (below: what differs)" if bad else ""))
    elif cluster:
        rows = [[escape(r.check), f"[{STYLE[r.verdict]}]{r.verdict}[/]", escape(r.detail)] for r in cluster]
        console.print(make_table([Column("check", whole=True), Column("verdict", whole=True), Column("detail")],
                                 rows, title="across nodes", keep=("check", "verdict", "detail")))
    if report.collective and report.collective.get("sizes"):
        rows = [[f"{s['bytes'] >> 20} MiB", f"{s['time_us']:.0f} us", f"{s['algbw_gbs']:.2f}", f"{s['busbw_gbs']:.2f}",
                 "yes" if s["ok"] else "[red]NO[/]"] for s in report.collective["sizes"]]
        headers = ("size", "time", "algbw GB/s", "busbw GB/s", "correct")
        console.print(make_table([Column(h, "right", whole=True) for h in headers], rows, keep=headers,
                                 title=f"all-reduce ({report.collective['backend']}, {report.collective['world']} "
                                       f"ranks)"))
    for r in report.results:
        if r.verdict in (FAIL, WARN):
            colour = STYLE[r.verdict]
            console.print(f"[{colour}]{r.verdict.upper()}[/] " + escape(_hanging(
                f"{r.node} {r.check}: {r.detail}", console.width, len(r.verdict) + 1, "  ")))
            if r.hint:
                console.print(escape(_hanging(f"fix: {r.hint}", console.width, 0, "       ", first="  ")))
    env = report.recommended_env()
    if env:
        console.print("recommended env: for hosts.yaml (per node):")
        console.print(escape(yaml.safe_dump({"nodes": [{"name": n, "env": e} for n, e in env.items()]},
                                            sort_keys=False)).rstrip(), highlight=False)
    verdict = "FAILED" if report.failed or report.unreachable else "passed"
    console.print(f"preflight {verdict}: {len(report.failed)} failure(s), {len(report.warned)} warning(s)")
    if not full:
        console.print("every check of every node: nodectl preflight --all (or --json)")


def _hanging(text: str, width: int, taken: int, indent: str, first: str = "") -> str:
    """`text` wrapped at word boundaries to `width` (its first line after `taken` columns already printed),
    every line after the first indented, so a long fix reads as one block instead of being cut mid-word."""
    return "\n".join(textwrap.wrap(text, width=max(20, width - taken), initial_indent=first,
                                   subsequent_indent=indent, break_on_hyphens=False))


def _print_matrix(console, report: PreflightReport, per_node: list) -> None:
    checks = list(dict.fromkeys(r.check for r in per_node))
    rows = []
    for node in report.nodes:
        cells = {r.check: r for r in per_node if r.node == node}
        rows.append([escape(node), *(f"[{STYLE[cells[c].verdict]}]{cells[c].verdict}[/]" if c in cells else "-"
                                     for c in checks)])
    columns = [Column("node", key=True), *(Column(escape(c), whole=True) for c in checks)]
    console.print(make_table(columns, rows, title="preflight", keep=["node", *checks]))


def show_history(app, history, node: str | None) -> None:
    """`preflight --history [NODE]`: every recorded figure (of NODE's parts), a row per preflight and part;
    with --json, the rows."""
    rows, events = history.rows(node), history.events(node)
    if app.json:
        app.emit_json({"history": str(history.path), "node": node, "rows": rows, "events": events})
        return
    if events:
        cells = [[time.strftime("%Y-%m-%d %H:%M", time.localtime(e["time"])), escape(str(e.get("node"))),
                  escape(str(e.get("run"))), escape(_event_text(e))] for e in events]
        columns = [Column("when", whole=True), Column("node", whole=True), Column("run", whole=True),
                   Column("what the run saw")]
        app.out.print(make_table(columns, cells, title=f"held back, failed and broken in runs{f' on {node}' if node else ''}",
                                 keep=("when", "node")))
    if not rows:
        app.info(f"no measured preflight recorded{f' for {node}' if node else ''} in {history.path} (the default and "
                 f"--full tiers record their figures; --quick measures none)")
        return
    cells = [[time.strftime("%Y-%m-%d %H:%M", time.localtime(r["time"])), escape(str(r.get("label"))),
              escape(str(r.get("metric"))), f"{r.get('value', 0):.1f}", "" if r.get("judged", True) else "kept"]
             for r in rows]
    columns = [Column("when", whole=True), Column("part"), Column("figure", whole=True),
               Column("value", "right", whole=True), Column("", whole=True)]
    app.out.print(make_table(columns, cells, title=f"preflight history{f' of {node}' if node else ''}",
                             keep=("when", "part", "value")))
    app.info(f"from {history.path}")


def _event_text(event: dict) -> str:
    """A straggler verdict, a failure or a part's event of the history, as one line."""
    if event["event"] == "straggler":
        slower = event.get("slower")
        causes = [c for c in event.get("causes") or [] if isinstance(c, str)]
        return (f"straggler: rank {event.get('rank')}"
                + (f", {slower:.0%} slower" if isinstance(slower, (int, float)) else "")
                + (f"; {'; '.join(causes)}" if causes else "; no cause seen"))
    if event["event"] == "hardware":
        counter, rise = str(event.get("counter")), event.get("rise")
        what = "lost" if counter == "lost" else f"{rise} {counter}" if counter.startswith("Xid") else \
            f"{counter} rose by {rise}"
        return f"hardware: {event.get('part')}: {what}" + (" (stopped the run)" if event.get("fatal") else "")
    return f"failed ({event.get('kind')}): {event.get('description') or 'no description'}"
