"""The `nodectl` command group. Each command lives in its own module and is registered here explicitly."""
from __future__ import annotations

import errno
import logging
import os

import click

from nodectl import __version__
from nodectl.cli.context import AppContext
from nodectl.errors import EXIT_FAILED, EXIT_INTERRUPTED, install_signal_handlers
from nodectl.transport import DEFAULT_CONNECT_TIMEOUT, DEFAULT_FANOUT, TransportOptions


def quiet_libraries() -> None:
    """paramiko logs a failed handshake with a traceback through Python's last-resort handler; nodectl reports
    the failure itself, in one line per node. NODECTL_DEBUG=1 keeps the library's logging."""
    if os.environ.get("NODECTL_DEBUG") != "1":
        logging.getLogger("paramiko").addHandler(logging.NullHandler())
        logging.getLogger("paramiko").propagate = False


class NodectlGroup(click.Group):
    """Click turns Ctrl-C into "Aborted!" and exit 1; nodectl says it was interrupted and exits 130 (SPEC §2),
    after the command has stopped whatever it started."""

    def main(self, *args, **kwargs):
        install_signal_handlers()
        quiet_libraries()
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as exc:
            raise SystemExit(exc.exit_code) from None
        except click.ClickException as exc:
            exc.show()
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


@click.group(cls=NodectlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-i", "--inventory", envvar="NODECTL_INVENTORY", metavar="INVENTORY",
              help="hosts.yaml or hostfile (default: $NODECTL_INVENTORY, ./hosts.yaml, else this machine).")
@click.option("-v", "--verbose", count=True, help="More detail (repeatable).")
@click.option("-q", "--quiet", is_flag=True, help="Only results and errors.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout, nothing else there.")
@click.option("--accept-new-host-keys", is_flag=True,
              help="Record unknown SSH host keys (like ssh's accept-new); a changed key is still refused.")
@click.option("--connect-timeout", type=click.FloatRange(min=0.5), default=DEFAULT_CONNECT_TIMEOUT,
              show_default=True, help="Seconds to wait for each node's SSH connection.")
@click.option("--fanout", type=click.IntRange(min=1), default=DEFAULT_FANOUT, show_default=True,
              help="Nodes worked on at once.")
@click.version_option(__version__, prog_name="nodectl")
@click.pass_context
def main(ctx: click.Context, inventory, verbose, quiet, as_json, accept_new_host_keys, connect_timeout, fanout):
    """Check, launch and watch multi-node PyTorch training over plain SSH."""
    ctx.obj = AppContext(
        inventory_option=inventory, verbose=verbose, quiet=quiet, json=as_json,
        transport_options=TransportOptions(connect_timeout=connect_timeout, fanout=fanout,
                                           accept_new_host_keys=accept_new_host_keys))


def _register() -> None:
    from nodectl.cli import collect, env_dump, launch, preflight, report, runs, stacks, status, stop, tail

    for module in (preflight, env_dump, launch, tail, status, stacks, stop, collect, runs, report):
        main.add_command(module.command)


_register()
