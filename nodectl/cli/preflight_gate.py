"""The quick preflight `launch` runs first: refuse to start on a failure, reuse a recent passing report."""
from __future__ import annotations

from nodectl.errors import RunFailed, UnreachableError, UsageError
from nodectl.preflight.host import UNSAFE_FIX
from nodectl.inventory import Inventory
from nodectl.cli.preflight_table import print_report
from nodectl.preflight.run import reusable, run_preflight, save


def quick_gate(app, inventory: Inventory, gpus: int | None) -> tuple[dict, dict]:
    """(probe reports per node, the preflight document) or an error that stops the launch."""
    cached = reusable(inventory, gpus)
    if cached:
        app.info("preflight: reusing a passing report from the last 10 minutes")
        return cached["reports"], cached
    app.info("preflight (quick): probing every node; --skip-preflight skips this")
    with app.cluster(inventory) as cluster, app.node_progress("preflight: probing nodes",
                                                               len(inventory.nodes)) as advance:
        report = run_preflight(inventory, cluster, gpus=gpus, quick=True, full=False,
                               connect_timeout=app.transport_options.connect_timeout, on_probe=advance)
    save(report, inventory, gpus)
    if report.unreachable or report.failed:
        print_report(app.err, report)
        problem = "; ".join(f"{r.node} {r.check}: {r.detail}" for r in report.failed[:3])
        unsafe = any(r.check == "workdir" and r.hint == UNSAFE_FIX for r in report.failed)
        error = UnreachableError if report.unreachable else UsageError if unsafe else RunFailed
        raise error(f"preflight failed, nothing was started ({problem}). Fix it, or --skip-preflight")
    return report.reports, report.to_json()
