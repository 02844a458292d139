"""`nodectl preflight`: probe every node in parallel and judge what would otherwise cost a day of a stuck run."""
from __future__ import annotations

import click

from nodectl.cli.context import AppContext
from nodectl.cli.options import node_selection
from nodectl import environment as environments
from nodectl.remote.envs import use_built
from nodectl.inventory import MAX_RANKS_PER_NODE
from nodectl.errors import EXIT_FAILED, EXIT_UNREACHABLE
from nodectl.cli.preflight_table import print_report
from nodectl.preflight.checks import Tier
from nodectl.preflight.collective_job import DEFAULT_DEADLINE_S
from nodectl.preflight.history import DRIFT_FAIL, DRIFT_WARN, History
from nodectl.preflight.sequence import preflight
from nodectl.cli.preflight_table import show_history
from nodectl.runs import state_dir


@click.command("preflight")
@click.argument("inventory_path", metavar="[INVENTORY]", required=False)
@node_selection
@click.option("--gpus", type=click.IntRange(1, MAX_RANKS_PER_NODE), help="Ranks per node the launch will use.")
@click.option("--quick", is_flag=True, help="The probe's checks only: no GPU job, no collective test.")
@click.option("--full", is_flag=True, help="Collective sizes up to 4 GiB, and node-pair tests.")
@click.option("--all", "show_all", is_flag=True, help="Print every check of every node (the full matrix).")
@click.option("--collective-timeout", type=click.IntRange(5, 3600), default=DEFAULT_DEADLINE_S, show_default=True,
              metavar="SECONDS", help="Longest wait of the collective test for a peer or one all-reduce.")
@click.option("--drift-warn", type=click.IntRange(1, 99), default=round(DRIFT_WARN * 100), show_default=True,
              metavar="PCT", help="Warn when a measured figure is this many percent below its own past.")
@click.option("--drift-fail", type=click.IntRange(1, 99), default=round(DRIFT_FAIL * 100), show_default=True,
              metavar="PCT", help="Fail when a measured figure is this many percent below its own past.")
@click.option("--history", "history_of", is_flag=False, flag_value="", default=None, metavar="[NODE]",
              help="Show the recorded figures over time (of NODE's parts), and check nothing.")
@click.pass_obj
def command(app: AppContext, inventory_path, nodes, exclude, gpus, quick, full, collective_timeout,
            show_all, drift_warn, drift_fail, history_of) -> None:
    """Check every node (GPUs, P2P, IB, versions, ports, clocks, shm...) and run a collective test."""
    if history_of is not None:
        show_history(app, History(state_dir()), history_of or None)
        return
    if quick and full:
        raise click.UsageError("--quick and --full ask for opposite tiers; give one of them")
    if drift_fail <= drift_warn:
        raise click.UsageError(f"--drift-fail ({drift_fail}) must be above --drift-warn ({drift_warn})")
    tier = Tier.QUICK if quick else Tier.FULL if full else Tier.DEFAULT
    inventory = app.inventory(inventory_path).select(nodes, exclude)
    inventory = environments.bind_locks(inventory, ".")   # environment: files are read from the project here
    with app.session() as session, \
            session.progress("probing nodes", len(inventory.nodes)) as advance:
        inventory = use_built(session.cluster(inventory.nodes), inventory)
        checked = preflight(inventory, session, tier=tier, gpus=gpus, on_probe=advance, deadline=collective_timeout,
                            history=History(state_dir()), drift=(drift_warn / 100, drift_fail / 100))
    report, drift, path = checked.report, checked.drift, checked.saved
    if app.json:
        app.emit_json({**report.to_json(), "saved": str(path)})
    else:
        print_report(app.out, report, full=show_all)
        if drift.summary:
            app.info(drift.summary)
        app.info(f"report saved to {path}")
    if report.unreachable:
        raise SystemExit(EXIT_UNREACHABLE)
    if report.failed:
        raise SystemExit(EXIT_FAILED)
