"""Rendering a LaunchPlan into per-node files with Jinja2.

StrictUndefined turns a missing variable into an error naming it; the `q` and `qpath` filters are the only way a
value reaches the script, so no user value is ever read by a shell as code. A user template is used only when
asked for (`--template PATH`): a cloned project's own templates/ folder is never picked up by itself. Every
template renders in Jinja2's immutable sandbox, so a template can read the plan but not reach Python (no
`__class__`, `__globals__`, `os.system`) on the controller, where it renders.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nodectl import __version__
from nodectl.container import container_name
from nodectl.errors import UsageError
from nodectl.inventory import ENV_NAME_RE as ENV_NAME
from nodectl.plan import LaunchPlan, NodePlan
from nodectl.resources import resource_dir
from nodectl.resources.launchers import runlayout as layout
from nodectl.secrets import redact_args, redact_env, redact_text
from nodectl.transport import quote_path

LAUNCH_TEMPLATE = "launch_node.sh.j2"
ENV_TEMPLATE = "env.sh.j2"


@dataclass(frozen=True)
class RenderedNode:
    node: str
    launch: str        # launch.sh
    env: str           # env.sh, with real values: only ever written 0600 on the node
    env_redacted: str  # what may be shown or stored locally
    launch_redacted: str = ""  # launch.sh with secret-looking arguments as '***': what is shown or stored locally


def _quote(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise jinja2.TemplateError(f"refusing to quote a {type(value).__name__} into a shell script")
    return shlex.quote(str(value))


def _quote_path(value) -> str:
    return quote_path(str(value))


def _environment(search: list[Path]) -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(loader=jinja2.FileSystemLoader([str(p) for p in search]),
                                        undefined=jinja2.StrictUndefined, autoescape=False,
                                        keep_trailing_newline=True)
    env.filters["q"] = _quote
    env.filters["qpath"] = _quote_path
    return env


def template_search_path(user_template: str | None) -> tuple[list[Path], str]:
    """Where launch templates come from: --template when given, else nodectl's own (a project's templates/ is
    used only through --template)."""
    search, name = [], LAUNCH_TEMPLATE
    if user_template:
        path = Path(user_template)
        if not path.is_file():
            raise UsageError(f"--template {user_template}: no such file")
        search.append(path.resolve().parent)
        name = path.name
    search.append(resource_dir("templates"))
    return search, name


def render_plan(plan: LaunchPlan, user_template: str | None = None) -> list[RenderedNode]:
    search, name = template_search_path(user_template)
    environment = _environment(search)
    rendered = []
    for node_plan in plan.nodes:
        rendered.append(_render_node(environment, name, plan, node_plan))
    return rendered


def shown_node(np: NodePlan) -> NodePlan:
    """The node plan as it may be shown or stored: its container's options and mounts through the same redaction
    as a command line (`-e WANDB_API_KEY=...` becomes `-e WANDB_API_KEY=***`). The node's own launch.sh keeps
    the real words."""
    container = np.node.container
    if container is None:
        return np
    hidden = replace(container, options=tuple(redact_args(container.options)),
                     mounts=tuple(redact_text(mount) for mount in container.mounts))
    return replace(np, node=replace(np.node, container=hidden))


ENV_OPTIONS = ("-e", "--env")


def container_env_options(container) -> tuple[tuple[str, ...], dict[str, str]]:
    """The container's options with every `-e NAME=VALUE` (`--env NAME=VALUE`, `--env=NAME=VALUE`) taken out, and
    those variables: their values go to env.sh (0600) and reach the container by name like every variable of the
    run's environment, so no value sits on the runtime's command line, where `ps` shows it to every user of the
    node (apptainer passes the host's environment in by itself)."""
    if container is None:
        return (), {}
    kept, moved, words = [], {}, list(container.options)
    i = 0
    while i < len(words):
        word, value = words[i], None
        if word in ENV_OPTIONS and i + 1 < len(words) and "=" in words[i + 1]:
            value, i = words[i + 1], i + 2
        elif word.startswith(("--env=", "-e")) and "=" in word[len("--env=" if word.startswith("--env=") else "-e"):]:
            value, i = word[len("--env=" if word.startswith("--env=") else "-e"):], i + 1   # --env=N=v, -eN=v
        else:
            kept.append(word)
            i += 1
            continue
        name, _, setting = value.partition("=")
        if not ENV_NAME.match(name):
            kept += [word] if word.startswith(("--env=", "-e")) and word not in ENV_OPTIONS else [word, value]
            continue
        moved[name] = setting   # passed by name with the rest of env.sh (docker, podman, enroot: --env NAME)
    return tuple(kept), moved


def _render_node(environment: jinja2.Environment, name: str, plan: LaunchPlan, np: NodePlan) -> RenderedNode:
    for key in np.env:
        if not ENV_NAME.match(key):
            raise UsageError(f"environment variable name {key!r} of node {np.node.name} is not valid")
    options, moved = container_env_options(np.node.container)
    env = {**np.env, **moved, "NODECTL_ATTEMPT": str(plan.attempt)}  # 0, then 1, 2, ... for --resume and restarts
    context = {"plan": plan, "np": np, "version": __version__, "env_names": sorted(env),
               "container_name": container_name(plan.run_id, np.node.name), "container_options": options,
               "rank_writable": layout.RANK_WRITABLE, "hidden": layout.HIDDEN}
    try:
        launch = environment.get_template(name).render(**context)
        shown = replace(plan, command=tuple(redact_args(plan.command)))
        launch_redacted = environment.get_template(name).render(**{**context, "plan": shown, "np": shown_node(np)})
        env_text = environment.get_template(ENV_TEMPLATE).render(env=env, **context)
        redacted = environment.get_template(ENV_TEMPLATE).render(env=redact_env(env), **context)
    except jinja2.exceptions.SecurityError as exc:
        raise UsageError(f"template {name}: refused by the sandbox ({exc})") from None
    except jinja2.UndefinedError as exc:
        raise UsageError(f"template {name}: {exc.message} (undefined variable)") from None
    except jinja2.TemplateError as exc:
        raise UsageError(f"template {name}: {exc}") from None
    return RenderedNode(node=np.node.name, launch=launch, env=env_text, env_redacted=redacted,
                        launch_redacted=launch_redacted)
