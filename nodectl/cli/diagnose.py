"""`nodectl diagnose`: why a run hangs, naming the rank, the node, the collective and the line."""
from __future__ import annotations

import click
from rich.markup import escape

from nodectl.cli.context import AppContext
from nodectl.cli.run_option import opened, run_option
from nodectl.diagnose.gather import Diagnosis, diagnose
from nodectl.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE
from nodectl.secrets import redact_tree, redact_words
from nodectl.terminal_text import visible

NOT_A_HANG = ("healthy", "ended", "unknown")


@click.command("diagnose")
@run_option
@click.option("--lines", type=click.IntRange(min=0, max=1000), default=5, show_default=True,
              help="Last log lines shown per culprit rank.")
@click.pass_obj
def command(app: AppContext, run_id: str | None, lines: int) -> None:
    """Name the rank(s) holding a hung run up: every rank's flight recorder, stacks, CPU and heartbeat, judged.

    Exit 0 with a verdict, 1 when the run is healthy or nothing could be judged, 3 when a node cannot be
    reached. Everything gathered stays under runs/<run_id>/diagnosis/."""
    run = opened(app, run_id)
    run_nodes = run.nodes()
    with app.cluster_for(run_nodes) as cluster, app.node_progress("diagnosing", len(run_nodes)) as advance:
        diagnosis = diagnose(run, cluster, lines=max(lines, 20), on_done=advance)
    if app.json:
        app.emit_json(redact_tree(diagnosis.to_json()))
    else:
        print_diagnosis(app, diagnosis, lines=lines)
    if diagnosis.unreachable:
        raise SystemExit(EXIT_UNREACHABLE)
    raise SystemExit(EXIT_FAILED if diagnosis.verdict.kind in NOT_A_HANG else EXIT_OK)


def print_diagnosis(app: AppContext, diagnosis: Diagnosis, lines: int = 5, console=None,
                    stopping: bool = False) -> None:
    """The verdict in one line, then the evidence per rank, the culprits' last lines, and what to do (`stopping`:
    the launch is stopping the run itself, so advice to stop it is replaced by saying so)."""
    out = console or app.out
    verdict = diagnosis.verdict
    colour = "green" if verdict.kind == "healthy" else "red"
    out.print(f"[bold {colour}]{escape(visible(redact_words(verdict.summary)))}[/]")
    if verdict.evidence:
        out.print("[bold]evidence[/]")
        for line in (*verdict.evidence, *diagnosis.gpu_lines()):
            out.print(f"  {escape(visible(redact_words(line)))}")
    views = {v.rank: v for v in diagnosis.views}
    for rank in verdict.culprits[:4]:
        tail = (views[rank].log_tail if rank in views else "").splitlines()[-lines:] if lines else []
        if tail:
            out.print(f"[bold]last lines of rank {rank}[/]")
            for line in tail:
                out.print(f"  {escape(visible(redact_words(line)))}")
    advice = [line for line in verdict.advice if not (stopping and "nodectl stop" in line)]
    if stopping:
        advice.append("nodectl is stopping the run now (--on-stall stop); `nodectl launch --resume RUN` continues "
                      "it from its last checkpoint once the cause is fixed")
    if advice:
        out.print("[bold]what to do[/]")
        for line in advice:
            out.print(f"  - {escape(visible(redact_words(line)))}")
    if diagnosis.folder is not None:
        out.print(f"[dim]stacks, flight recorder and node answers: {escape(str(diagnosis.folder))}/ "
                  f"({diagnosis.seconds:.1f} s)[/]")
