"""The `nodectl` command group. Each command lives in its own module, named here (`COMMANDS`) and imported when it
is run: `nodectl status` loads status's module, not launch's and preflight's."""
from __future__ import annotations

import atexit
import errno
import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import click

from nodectl.cli.context import AppContext
from nodectl.cli.options import Seconds
from nodectl.errors import EXIT_FAILED, EXIT_INTERRUPTED, InventoryError, NodectlError, install_signal_handlers
from nodectl.transport import DEFAULT_CONNECT_TIMEOUT, DEFAULT_FANOUT, TransportOptions


def quiet_libraries() -> None:
    """paramiko logs a failed handshake with a traceback through Python's last-resort handler; nodectl reports
    the failure itself, in one line per node. NODECTL_DEBUG=1 keeps the library's logging."""
    if os.environ.get("NODECTL_DEBUG") != "1":
        logging.getLogger("paramiko").addHandler(logging.NullHandler())
        logging.getLogger("paramiko").propagate = False


GLOBAL_FLAGS = {"-q", "--quiet", "--json", "--accept-new-host-keys", "-v", "--verbose"}
GLOBAL_VALUED = {"-i", "--inventory", "--connect-timeout", "--fanout"}


def _global_option(args: list[str], i: int) -> int:
    """How many words at args[i] form a global option (0 if none): `--json`, `-vv`, `-i FILE`, `--fanout=8`."""
    word = args[i]
    name = word.split("=", 1)[0]
    if word in GLOBAL_FLAGS or (len(word) > 1 and word.startswith("-v") and set(word[1:]) == {"v"}):
        return 1
    if name in GLOBAL_VALUED and name.startswith("--") and "=" in word:
        return 1
    if word in GLOBAL_VALUED:
        return 2 if i + 1 < len(args) else 1
    return 0


def hoist_global_options(args: list[str], commands: Mapping[str, click.Command]) -> list[str]:
    """`nodectl tail rank0 --json` means `nodectl --json tail rank0`: global options given after the command name
    move in front of it. Only up to `--`, and for commands that pass their arguments on (launch, exec) only up to
    their first argument: what follows belongs to the user's program."""
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += max(1, _global_option(args, i))
    if i >= len(args) or args[i] not in commands:
        return args
    command = commands[args[i]]
    interspersed = command.context_settings.get("allow_interspersed_args", command.allow_interspersed_args)
    valued = {name for p in command.params if isinstance(p, click.Option) and not p.is_flag and not p.count
              for name in p.opts}
    head, rest, moved, j = args[:i + 1], [], [], i + 1
    while j < len(args):
        word = args[j]
        if word == "--" or (not interspersed and not word.startswith("-")):
            rest.extend(args[j:])
            break
        taken = _global_option(args, j)
        if taken:
            moved.extend(args[j:j + taken])
        else:
            taken = 2 if word in valued else 1
            rest.extend(args[j:j + taken])
        j += taken
    return moved + head + rest


# Each command's name and its module under nodectl/cli (its `command`).
COMMANDS = {"preflight": "preflight", "env-dump": "env_dump", "launch": "launch", "exec": "exec_cmd", "tail": "tail",
            "status": "status", "top": "top", "stacks": "stacks", "diagnose": "diagnose", "stop": "stop",
            "collect": "collect", "runs": "runs", "report": "report"}


class _Commands(Mapping):
    """The group's commands by name, each imported when it is first looked up."""

    def __init__(self, group: NodectlGroup) -> None:
        self.group = group

    def __getitem__(self, name: str) -> click.Command:
        command = self.group.get_command(None, name)
        if command is None:
            raise KeyError(name)
        return command

    def __iter__(self) -> Iterator[str]:
        return iter(COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS)


class NodectlGroup(click.Group):
    """Click turns Ctrl-C into "Aborted!" and exit 1; nodectl says it was interrupted and exits 130 (docs/REFERENCE.md §2),
    after the command has stopped whatever it started. Global options are accepted after the command too. Commands
    are imported when looked up: the one that runs, or all of them for the group's help."""

    def list_commands(self, ctx: click.Context | None) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context | None, name: str) -> click.Command | None:
        if name not in self.commands and name in COMMANDS:
            self.add_command(importlib.import_module(f"nodectl.cli.{COMMANDS[name]}").command)
        return self.commands.get(name)

    @property
    def every_command(self) -> Mapping[str, click.Command]:
        return _Commands(self)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist_global_options(list(args), self.every_command))

    def main(self, *args, **kwargs):
        install_signal_handlers()
        quiet_libraries()
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as exc:
            raise SystemExit(exc.exit_code) from None
        except click.ClickException as exc:   # click's own: a usage error shows the usage line too
            exc.show()
            raise SystemExit(exc.exit_code) from None
        except NodectlError as exc:   # the library's: what was wrong, where, what to do
            click.echo(f"Error: {exc.format_message()}", err=True)
            raise SystemExit(exc.exit_code) from None
        except (click.Abort, KeyboardInterrupt):
            click.echo("interrupted", err=True)
            raise SystemExit(EXIT_INTERRUPTED) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            where = f" writing {exc.filename}" if exc.filename else ""
            click.echo(f"Error: the local disk is full{where}; free space (or point NODECTL_RUNS elsewhere) and "
                       f"run the command again", err=True)
            raise SystemExit(EXIT_FAILED) from None


def _show_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """--version, read from the installed package only when asked for (importlib.metadata is not loaded otherwise)."""
    if value and not ctx.resilient_parsing:
        from nodectl import __version__

        click.echo(f"nodectl, version {__version__}")
        ctx.exit()


@click.group(cls=NodectlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-i", "--inventory", envvar="NODECTL_INVENTORY", metavar="INVENTORY",
              help="hosts.yaml or hostfile (default: $NODECTL_INVENTORY, ./hosts.yaml, else this machine).")
@click.option("-v", "--verbose", count=True, help="More detail (repeatable).")
@click.option("-q", "--quiet", is_flag=True, help="Only results and errors.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout, nothing else there.")
@click.option("--accept-new-host-keys", is_flag=True,
              help="Record unknown SSH host keys (like ssh's accept-new); a changed key is still refused.")
@click.option("--connect-timeout", type=Seconds(min=0.5), default=DEFAULT_CONNECT_TIMEOUT,
              show_default=True, help="Seconds to wait for each node's SSH connection.")
@click.option("--fanout", type=click.IntRange(min=1), default=DEFAULT_FANOUT, show_default=True,
              help="Nodes worked on at once.")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Show the version and exit.")
@click.pass_context
def main(ctx: click.Context, inventory, verbose, quiet, as_json, accept_new_host_keys, connect_timeout, fanout):
    """Check, launch and watch multi-node PyTorch training over plain SSH."""
    if inventory and not ctx.resilient_parsing and (not Path(inventory).exists() or Path(inventory).is_dir()):
        # every command, those that read only recorded runs (status, runs) too: a typo is said, never ignored
        raise InventoryError(inventory, "file", "not found" if not Path(inventory).exists() else "a folder, not a file")
    ctx.obj = AppContext(
        inventory_option=inventory, verbose=verbose, quiet=quiet, json=as_json,
        transport_options=TransportOptions(connect_timeout=connect_timeout, fanout=fanout,
                                           accept_new_host_keys=accept_new_host_keys))


def run() -> None:
    """The `nodectl` program: the command, then a prompt exit. Python's own teardown (module cleanup, the SSH
    connections' threads) needs little CPU, but on a controller whose cores are busy (node 0 of the run itself,
    its ranks importing torch) it took 0.5 s at 8 nodes and 3 s at 32, after everything was done. Exit
    handlers run and output is flushed first; while a thread that is not a daemon lives, the normal exit waits
    for it."""
    os.umask(os.umask(0o077) | 0o077)  # what nodectl writes here (run records, reports, collected outputs) is private
    try:
        main(prog_name="nodectl")
        code = 0
    except SystemExit as exc:
        code = exc.code
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (nodectl runs | head)
            pass
    os._exit(code)
