"""A launch request: the command line's options checked and turned into what the pipeline needs (the job's
inputs and how to attend it), before any node is touched. `--resume` reads the recorded plan here
(`LaunchPlan.from_json`: typed, each field checked, nodes through the inventory's rules)."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from nodectl import environment as environments, outputs as stores
from nodectl.errors import UsageError
from nodectl.inventory import Inventory
from nodectl.launch.attending import Attending
from nodectl.launch.gate import NO_GATE, Gate
from nodectl.launch.job import JobSpec
from nodectl.plan import LaunchPlan
from nodectl.remote import sync
from nodectl.runs import Run
from nodectl.secrets import REDACTED, redact_args, redact_value


@dataclass(frozen=True)
class LaunchRequest:
    """What to start (`spec`) and how the attended run is watched. Which stages run is the caller's choice
    (nodectl/launch/pipeline.py: `stages_for`)."""

    spec: JobSpec
    attending: Attending = Attending()   # how the attached launch watches the run (launch/attending.py)
    skip_preflight: bool = False
    previous: Run | None = None      # --resume: the run whose next attempt this is
    withheld: tuple[sync.Withheld, ...] = ()   # project files that do not travel (the inventory, secrets)
    gate: Gate = NO_GATE             # the preflight before a start and for a restart's nodes (launch/gate.py)

    @property
    def secret_on_command_line(self) -> bool:
        """An argument of the user's command looks like a secret: stored as ***, but on the nodes it sits on
        the command line, visible to every user there."""
        return redact_args(self.spec.command) != list(self.spec.command)


def launch_request(load_inventory: Callable[[], Inventory], open_run: Callable[[str], Run], *, argv: tuple[str, ...],
                   nodes=None, exclude=(), gpus=None, config=None, sync_dir=".", sync_limit=None, template=None,
                   skip_preflight=False, detach=False, attending: Attending = Attending(), force=False,
                   overrides=(), environment=None, outputs_url=None, resume_run=None, command=(),
                   gate: Gate = NO_GATE, **_output_options) -> LaunchRequest:
    """The request `nodectl launch` makes of its options; a usage error (exit 2) for any that cannot go together.
    `_output_options` (--dry-run, --follow) change what is shown, not what is launched."""
    for position, argument in enumerate(command, 1):
        try:
            argument.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"argument {position} after `--` is not UTF-8 text ({os.fsencode(argument)!r}"
                             f"): nodectl records and quotes arguments as UTF-8") from None
    attending.check(detach)
    if resume_run is not None and not resume_run.strip():
        raise UsageError("--resume: an empty run id (nodectl runs lists them)")
    previous = open_run(resume_run) if resume_run else None
    if previous:
        inventory, gpus, command, config, sync_dir, attending, overrides = _resume_args(
            previous, load_inventory(), command, config, attending, overrides)
    else:
        inventory = load_inventory().select(nodes, exclude)
    if outputs_url is not None:
        inventory = inventory.with_outputs(stores.from_option(outputs_url, inventory.outputs))
    inventory = _reachable_addresses(inventory)
    if command and (config or overrides):
        raise UsageError(f"{'--config' if config else '--set'} is for the built-in trainer's recipe; your script "
                         f"takes its own options after its name: nodectl launch -- {command[0]} ...")
    if not command:
        _check_recipe(config, overrides)
    withheld: list[sync.Withheld] = []
    files = sync.project_files(sync_dir, (sync_limit or sync.DEFAULT_SYNC_LIMIT // 2**20) * 2**20,
                               inventory=None if inventory.builtin else inventory.source,
                               secrets=_secret_values(inventory), withheld=withheld)
    command = tuple(command) if previous else _check_command(tuple(command), files, sync_dir)
    config = os.path.abspath(config) if config else None
    if environment:
        inventory = environments.with_environment(inventory, environment)
    inventory = environments.bind_locks(inventory, sync_dir)
    uploader = ("nodectl_outputs.py",) if any(n.outputs for n in inventory.nodes) else ()
    spec = JobSpec(inventory, command=command, sync_dir=sync_dir,
                   files=tuple(files + sync.nodectl_files(not command, config, uploader)), gpus=gpus, config=config,
                   overrides=tuple(overrides), template=template, argv=argv,
                   run_id=previous.run_id if previous else None,
                   attempt=previous.read().attempt + 1 if previous else 0, any_port=force)
    return LaunchRequest(spec, attending, skip_preflight=skip_preflight, previous=previous, withheld=tuple(withheld),
                         gate=gate)


def _secret_values(inventory: Inventory) -> tuple[str, ...]:
    """The values of the inventory's env: settings that are secrets (by name or by shape): no synced file may
    carry one to the nodes' stores and the run folder's code/."""
    return tuple(sorted({str(value) for node in inventory.nodes for name, value in node.env.items()
                         if redact_value(name, str(value)) != str(value)}))


def _check_command(args: tuple[str, ...], files: list[sync.SyncFile], sync_dir: str) -> tuple[str, ...]:
    """SCRIPT must be a file inside the synced folder (its path made relative to it); -m needs a module."""
    if not args:
        return args
    if args[0] in ("-m", "--module"):
        if len(args) < 2 or not args[1] or args[1].startswith("-"):
            raise UsageError("-m needs a module name: nodectl launch -- -m package.module ARGS")
        return ("-m", *args[1:])
    script = Path(args[0])
    root = Path(sync_dir).resolve()
    absolute = (script if script.is_absolute() else Path.cwd() / script).resolve()
    synced = {f.path for f in files}
    if absolute.is_relative_to(root):
        relative = absolute.relative_to(root).as_posix()
    elif not script.is_absolute() and f"code/{script.as_posix()}" in synced:
        return (script.as_posix(), *args[1:])  # named relative to the synced folder
    else:
        raise UsageError(f"script {args[0]!r} is outside the synced folder {root}: only that folder reaches the "
                         f"nodes; move the script there or sync its folder (--sync DIR)")
    if f"code/{relative}" in synced:
        return (relative, *args[1:])
    if absolute.is_dir():
        raise UsageError(f"script {args[0]!r} is a folder; name a Python file, or a module with -m package.module")
    if not absolute.exists():
        raise UsageError(f"script {args[0]!r} does not exist (looked for {absolute})")
    raise UsageError(f"script {args[0]!r} is excluded from the sync by .gitignore in {root}, so the nodes would not "
                     f"have it; un-ignore it or sync another folder")


def _check_recipe(config: str | None, overrides: tuple[str, ...]) -> None:
    """The built-in trainer's recipe (trainer/config.py, plain Python and yaml: no torch), checked before any
    node is touched (dry runs too): a typo is exit 2 now, not a failure on every rank later. Model and data paths
    name files on the nodes; the ranks check those."""
    from nodectl.resources.trainer import config as recipes

    try:
        recipes.load_recipe(config, list(overrides), node_files=False)
    except recipes.ConfigError as exc:
        raise UsageError(f"recipe error: {exc}") from None


def _reachable_addresses(inventory: Inventory) -> Inventory:
    """A node without `addr:` is reached by the others where ssh reaches it: an ~/.ssh/config alias as `host:`
    becomes its HostName (torchrun on the other nodes would retry resolving the alias for ever, silently)."""
    from nodectl.transport.ssh import ssh_hostname

    nodes = tuple(replace(node, addr=ssh_hostname(node.host)) if node.addr == node.host and not node.is_local else node
                  for node in inventory.nodes)
    return replace(inventory, nodes=nodes)


def _resume_args(previous: Run, current: Inventory, command: tuple, config: str | None, attending: Attending,
                 overrides: tuple[str, ...]):
    """What --resume relaunches: the recorded nodes (with today's inventory settings), ranks, command, config,
    and the recorded --max-restarts unless given again."""
    manifest = previous.read()
    plan = manifest.plan   # read through LaunchPlan.from_json's checks, as every record is
    recorded_attending = Attending.from_record(manifest.attending, f"run {previous.run_id}'s record")
    if command:
        raise UsageError("--resume relaunches the recorded command; give no SCRIPT")
    if current.builtin:
        current = current.select(plan.nnodes)
    nodes = tuple(_recorded_settings(replace(current.node(np.node.name), index=i), np.node)
                  for i, np in enumerate(plan.nodes))
    recorded = plan.command
    if REDACTED in recorded and not plan.builtin_trainer:
        raise UsageError(f"run {previous.run_id}'s command held a secret, recorded as {REDACTED}, so it cannot be "
                         f"replayed; launch it again with the secret in the inventory's env: (or the environment) "
                         f"instead")
    if plan.builtin_trainer:
        recorded = ()
        config = config or plan.config
    return (replace(current, nodes=nodes), plan.nodes[0].nproc, recorded, config, _recorded_sync_dir(previous, plan),
            replace(attending, max_restarts=attending.max_restarts or recorded_attending.max_restarts),
            overrides or plan.overrides)


def _recorded_sync_dir(previous: Run, plan: LaunchPlan) -> str:
    """The folder a resumed run syncs: the project the run was launched from (the folder holding its runs/), or a
    folder inside it, as recorded; a record naming any other folder (/etc, a home) is refused, never synced."""
    project = previous.folder.resolve().parent.parent
    synced = Path(plan.sync_dir).resolve()
    if synced != project and not synced.is_relative_to(project):
        raise UsageError(f"run {previous.run_id}'s record: plan.sync_dir {plan.sync_dir!r} is not the project the "
                         f"run was launched from ({project}) nor a folder inside it: refused (was the record "
                         f"edited?); launch again instead of resuming")
    return str(synced)


def _recorded_settings(node, recorded):
    """Today's inventory settings for a node of the run, with what the run recorded where today's say nothing: a
    run launched with --environment resumes in a venv of the same file (built again if it changed), and the run's
    bucket is found again from fresh nodes."""
    if recorded.outputs is not None and node.outputs is None:
        node = replace(node, outputs=recorded.outputs)
    if node.environment is not None or node.container is not None or recorded.environment is None:
        return node
    if REDACTED in str(recorded.environment.index_url or ""):
        raise UsageError(f"{node.name}: the run's environment index held credentials, recorded as {REDACTED}; set "
                         f"environment: {{file: ..., install: index, index_url: ...}} for it in hosts.yaml and resume")
    return replace(node, environment=recorded.environment)
