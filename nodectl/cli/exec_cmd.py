"""`nodectl exec -- CMD ARGS`: one command on every node at once, output grouped the way `clush -b` and
`dshbak -c` group it (nodes with identical output named once, as a host range)."""
from __future__ import annotations

import shlex
import sys

import click
from rich.markup import escape

from nodectl import hostlist
from nodectl.cli.context import AppContext
from nodectl.cli.options import Seconds, node_selection
from nodectl.errors import EXIT_FAILED, EXIT_UNREACHABLE, UsageError
from nodectl.transport import NodeResult

MAX_STDIN = 64 * 2**20
KILL_AFTER = 5


MARKER = "NODECTL-EXEC-OUTPUT"


def remote_command(args: tuple[str, ...], timeout: float) -> str:
    """One argument is a shell command line (pipes, globs, `$VAR` expand on the node), as with ssh; several are
    argv, each word intact. Either way the node's coreutils `timeout` ends it, so nothing outlives the call.
    A marker line on stdout and stderr first: what a login shell's start-up files print comes before it."""
    line = shlex.quote(args[0] if len(args) == 1 else shlex.join(args))
    return (f"printf '%s\\n' {MARKER}; printf '%s\\n' {MARKER} >&2; "
            f"if command -v timeout >/dev/null 2>&1; then exec timeout -k {KILL_AFTER} {timeout:g} /bin/sh -c {line}; "
            f"else exec /bin/sh -c {line}; fi")


def after_marker(text: str) -> str:
    head, found, rest = text.partition(MARKER + "\n")
    return rest if found else text


def group(results: list[NodeResult], timeout: float) -> list[dict]:
    """Nodes with the same outcome (exit code, stdout, stderr, or the same error) in one group, first seen first.
    Exit 124 is the node's `timeout` stopping the command."""
    groups: dict[tuple, dict] = {}
    for r in results:
        if r.ok:
            stdout, stderr = after_marker(r.value.stdout), after_marker(r.value.stderr)
            key = ("ran", r.value.exit_code, stdout, stderr)
            stopped = f"timed out after {timeout:g}s (stopped)" if r.value.exit_code == 124 else None
            entry = {"exit": r.value.exit_code, "stdout": stdout, "stderr": stderr, "error": stopped}
        else:
            key = ("error", r.unreachable, r.error)
            entry = {"exit": None, "stdout": "", "stderr": "", "error": r.error, "unreachable": r.unreachable}
        groups.setdefault(key, {**entry, "names": []})["names"].append(r.node.name)
    out = []
    for entry in groups.values():
        entry["nodes"] = hostlist.fold(entry["names"])
        out.append(entry)
    return out


@click.command("exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@node_selection
@click.option("--timeout", type=Seconds(min=1), default=60.0, show_default=True,
              help="Seconds each node's command may run; then it is stopped there (SIGTERM, SIGKILL 5 s later).")
@click.option("--stdin", "forward_stdin", is_flag=True,
              help="Send this command's standard input to every node (read whole first; at most 64 MiB).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def command(app: AppContext, nodes, exclude, timeout, forward_stdin, command) -> None:
    """Run CMD on every node in parallel; identical output is printed once with the nodes that gave it.

    One argument is a shell command line (nodectl exec 'nvidia-smi -L | wc -l'); several are passed as they
    are (nodectl exec -- ls -l "my dir"). Exit 0 if it succeeded everywhere, 1 if it failed on a node, 3 if a
    node could not be reached."""
    if command and command[0] == "--":
        command = command[1:]
    if not command or not command[0].strip():
        raise UsageError("exec needs a command: nodectl exec -- CMD ARGS")
    data = None
    if forward_stdin:
        data = sys.stdin.buffer.read(MAX_STDIN + 1)
        if len(data) > MAX_STDIN:
            raise UsageError(f"--stdin: more than {MAX_STDIN // 2**20} MiB on standard input")
    inventory = app.inventory().select(nodes, exclude)
    remote = remote_command(tuple(command), timeout)
    with app.cluster(inventory) as cluster, app.node_progress("running", len(inventory.nodes)) as advance:
        results = cluster.fan_out(lambda t: t.run(remote, stdin=data, timeout=timeout + KILL_AFTER + 10),
                                  on_done=advance)
    groups = group(results, timeout)
    failed = any(g["exit"] not in (0, None) or (g["error"] and not g.get("unreachable")) for g in groups)
    unreachable = any(g.get("unreachable") for g in groups)
    if app.json:
        app.emit_json({"command": list(command), "groups": groups,
                       "nodes": {name: {k: v for k, v in g.items() if k not in ("names", "nodes")}
                                 for g in groups for name in g["names"]}})
    else:
        for g in groups:
            _print_group(app, g)
    if unreachable:
        raise SystemExit(EXIT_UNREACHABLE)
    if failed:
        raise SystemExit(EXIT_FAILED)


def _print_group(app: AppContext, g: dict) -> None:
    count = len(g["names"])
    nodes = f"{g['nodes']} ({count} nodes)" if count > 1 else g["nodes"]
    if g["exit"] is None:
        what = "unreachable" if g.get("unreachable") else "failed"
        app.out.print(f"[bold red]{escape(nodes)}[/]: {what}: {escape(g['error'])}")
        return
    status = "" if g["exit"] == 0 else f" [red](exit {g['exit']}{': ' + g['error'] if g.get('error') else ''})[/]"
    app.heading(f"[bold]{escape(nodes)}[/]{status}")
    if g["stdout"]:
        app.out.print(g["stdout"].rstrip("\n"), markup=False, highlight=False)
    if g["stderr"]:
        app.out.print(g["stderr"].rstrip("\n"), markup=False, highlight=False, style="red")
