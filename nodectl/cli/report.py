"""`nodectl report [--run RUN]` (a positional RUN works too): plots under runs/<run_id>/report/ and a short summary, after `collect`."""
from __future__ import annotations

import json

import click

from nodectl import goodput
from nodectl.cli.context import AppContext
from nodectl.cli.run_option import run_option
from nodectl.errors import UsageError
from nodectl.report import load_collected, render, summarise
from nodectl.runs import open_run


@click.command("report")
@run_option
@click.argument("positional", metavar="[RUN]", required=False)
@click.pass_obj
def command(app: AppContext, run_id: str | None, positional: str | None) -> None:
    """Plot loss, eval loss, tokens/s, MFU, memory, GPU utilisation, step time per rank, the pace (where each
    rank's time went, straggler verdicts) and the timeline (attempts, set-up, start-up, training, failures,
    restarts, checkpoints; the goodput) of a collected run."""
    if run_id and positional and run_id != positional:
        raise UsageError(f"two runs named: --run {run_id} and {positional}; give one")
    run = open_run(run_id or positional)
    data = load_collected(run.folder)
    manifest = run.read()
    try:
        spent = goodput.of_run(run, manifest=manifest)
    except OSError:   # the timeline unreadable: the plots without it
        spent = None
    data["goodput"] = spent.to_json() if spent else None
    plots = render(data, run.folder / "report")
    summary = summarise(data)
    if summary["end_reason"] == "unknown" and manifest.state.final:   # a script of the user's: how its run ended
        failure = manifest.failure or {}
        summary["end_reason"] = manifest.state.value + (f": {failure['description']}"
                                                        if isinstance(failure.get("description"), str) else "")
    summary["goodput"] = data["goodput"]
    story = goodput.story(manifest, spent)
    (run.folder / "report" / "summary.json").write_text(json.dumps(summary, indent=2))
    if app.json:
        app.emit_json({"run_id": run.run_id, "summary": summary, "plots": [str(p) for p in plots]})
        return
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)
    app.out.print(f"run {run.run_id}: {summary['steps']} steps, loss {fmt(summary['first_loss'], '.4f')} -> "
                  f"{fmt(summary['last_loss'], '.4f')}, best eval loss {fmt(summary['best_eval_loss'], '.4f')}")
    app.out.print(f"throughput: {fmt(summary['tokens_per_s_per_gpu'], ',.0f')} tokens/s per GPU (median)")
    app.out.print(f"ended: {summary['end_reason']}")
    if spent and spent.line(live=False):
        app.out.print(spent.line(live=False))
    for line in story:
        app.out.print(f"  {line}")
    app.out.print(f"adapter: {summary['adapter'] or '-'}")
    app.out.print(f"plots: {', '.join(p.name for p in plots)} in {run.folder / 'report'}/")
