"""The architecture (docs/ARCHITECTURE.md) kept true: which side imports what, no import cycle, ruff clean."""
from __future__ import annotations

import ast
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PURE_PREFLIGHT = tuple(f"nodectl.preflight.{m}" for m in ("verdict", "checks", "host", "gpu", "network",
                                                                 "storage", "cluster", "judge"))
REMOTE = ("nodectl.remote", "nodectl.transport", "fabric", "paramiko")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Modules `path` imports, a function's deferred imports too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def package_modules(package: str) -> dict[str, Path]:
    return {module_name(p): p for p in (REPO / package).rglob("*.py")}


def test_launchers_and_trainer_import_nothing_of_nodectl():
    """They run on the nodes, where nodectl is not installed."""
    for package in ("launchers", "trainer"):
        for name, path in package_modules(package).items():
            bad = sorted(m for m in imports(path) if m == "nodectl" or m.startswith("nodectl."))
            assert not bad, f"{name} imports {bad}"


def test_pure_preflight_checks_reach_nothing_remote():
    """Judging is pure: the checks read reports, transitively importing nothing that talks to a node."""
    modules = package_modules("nodectl")
    for start in PURE_PREFLIGHT:
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name in seen or name not in modules:
                continue
            seen.add(name)
            for imported in imports(modules[name]):
                assert not imported.startswith(REMOTE), f"{start} reaches {imported} through {name}"
                todo.append(imported)


def test_only_the_cli_imports_the_cli():
    for name, path in package_modules("nodectl").items():
        # the program's entry points: nodectl.entry must load before the CLI package (a Ctrl-C while it loads)
        if name.startswith("nodectl.cli") or name in ("nodectl.__main__", "nodectl.entry"):
            continue
        bad = sorted(m for m in imports(path) if m.startswith("nodectl.cli"))
        assert not bad, f"{name} imports {bad}: the library must not depend on the command line"


LAYERS = {   # a layer may import the ones below it, never one above (docs/ARCHITECTURE.md)
    "nodectl.transport": ("nodectl.transport", "nodectl.inventory", "nodectl.progress"),
    "nodectl.remote": ("nodectl.launch", "nodectl.preflight", "nodectl.diagnose", "nodectl.cli", "nodectl.render",
                       "nodectl.watch", "nodectl.pace"),
}


def test_the_layer_rules_name_only_modules_that_exist():
    """A rule about a module that was moved or removed guards nothing: each name above is a module or package."""
    modules = package_modules("nodectl")
    for names in LAYERS.values():
        for name in names:
            assert any(m == name or m.startswith(name + ".") for m in modules), \
                f"the layer rules name {name}, which is no module of nodectl"


def test_the_transport_knows_only_nodes_and_the_node_client_nothing_of_launches():
    """transport/ (connections, quoting, fan-out) imports nothing of nodectl but the inventory's Node and the progress
    protocol; remote/ (the node client) nothing of the layers that use it."""
    modules = package_modules("nodectl")
    for name, path in modules.items():
        found = {m for m in imports(path) if m.startswith("nodectl")}
        if name.startswith("nodectl.transport"):
            allowed = LAYERS["nodectl.transport"]
            bad = sorted(m for m in found if not m.startswith(allowed))
            assert not bad, f"{name} imports {bad}: the transport sits below everything else"
        if name.startswith("nodectl.remote"):
            bad = sorted(m for m in found if m.startswith(LAYERS["nodectl.remote"]))
            assert not bad, f"{name} imports {bad}: the node client sits below launch, preflight and diagnose"


def assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    """A depth-first walk of `graph`; the first cycle found fails, spelled out."""
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph.get(name, ())):
            if state.get(nxt) == 1:
                raise AssertionError(f"{what} cycle: " + " -> ".join(trail[trail.index(nxt):] + [nxt]))
            if not state.get(nxt):
                visit(nxt, trail + [nxt])
        state[name] = 2

    for name in sorted(graph):
        if not state.get(name):
            visit(name, [name])


def test_no_import_cycle_among_nodectl_modules():
    modules = package_modules("nodectl")
    assert_acyclic({name: {m for m in imports(path) if m in modules and m != name}
                    for name, path in modules.items()}, "import")


def relative_imports(path: Path, package: str) -> set[str]:
    """Modules of `package` that `path` (a module directly in it) imports relatively (`from . import fp8`, `from
    .moe import X`), a function's deferred imports too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(f"{package}.{node.module}")
            else:
                found.update(f"{package}.{alias.name}" for alias in node.names)
    return found


def test_no_import_cycle_among_trainer_modules():
    """The trainer's modules import each other relatively: fp8 imported moe's wrappers inside a function while
    moe imported fp8 (the experts' conversion now lives in moe)."""
    modules = {name: path for name, path in package_modules("trainer").items() if name.count(".") == 1}
    assert_acyclic({name: {m for m in relative_imports(path, "trainer") if m in modules and m != name}
                    for name, path in modules.items()}, "import")


def package_of(module: str) -> str:
    """nodectl.launch.attend -> nodectl.launch; a top-level module (nodectl.pace) is its own."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    """Which of nodectl's packages imports which (a function's deferred imports too), the root package left out."""
    modules = package_modules("nodectl")
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for imported in imports(path):
            if imported in modules and imported != "nodectl" and package_of(imported) != package_of(name):
                graph.setdefault(package_of(name), set()).add(package_of(imported))
    return graph


def test_no_import_cycle_among_nodectl_packages():
    """A cycle between packages is one even where no two modules form it: launch/ imported preflight/ inside
    functions while preflight/ launched its collective jobs through launch/. The launch gets its preflight as a
    value (nodectl/launch/gate.py)."""
    graph = package_graph()
    assert "nodectl.preflight" not in graph.get("nodectl.launch", set()), \
        "launch/ imports preflight/: the CLI hands the launch its gate (nodectl/preflight/gate.py)"
    assert_acyclic(graph, "package")


def test_no_private_name_is_imported_across_modules():
    for package in ("nodectl", "trainer", "launchers/runctl"):
        for name, path in package_modules(package).items():
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and \
                        node.module.startswith(package.rsplit("/", 1)[-1]):
                    private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                    assert not private, f"{name} imports private {private} from {node.module}"


@pytest.mark.skipif(shutil.which("ruff", path=str(Path(sys.executable).parent)) is None
                    and shutil.which("ruff") is None, reason="ruff is not installed (pip install -e .[test])")
def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    result = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_only_the_transport_opens_connections():
    """fabric and paramiko are imported under nodectl/transport/ only: nothing else reaches a node by itself."""
    for name, path in package_modules("nodectl").items():
        if name.startswith("nodectl.transport"):
            continue
        bad = sorted(m for m in imports(path) if m.split(".")[0] in ("fabric", "paramiko", "invoke"))
        assert not bad, f"{name} imports {bad}: connections belong in nodectl/transport/"


OUTPUT_CALLS = {"print", "echo", "secho", "pprint"}
PATH_LOADS = {"spec_from_file_location", "exec_module", "run_path", "load_source", "exec()", "compile()", "eval()"}


def _calls(path: Path) -> set[str]:
    """Names of what `path` calls: `x.attr(...)` as attr, a bare builtin `f(...)` as f and "f()"."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                names.add(func.attr)
            elif isinstance(func, ast.Name):
                names.update((func.id, f"{func.id}()"))
    return names


def test_only_the_cli_prints_or_uses_click_and_rich():
    """The library returns data, events and errors; nodectl/cli/ turns them into output (and the program's first
    lines, nodectl.entry, say "interrupted" before anything is loaded)."""
    for name, path in package_modules("nodectl").items():
        if name.startswith("nodectl.cli") or name in ("nodectl.__main__", "nodectl.entry"):
            continue
        ui = sorted(m for m in imports(path) if m.split(".")[0] in ("click", "rich"))
        assert not ui, f"{name} imports {ui}: output belongs to nodectl/cli/"
        shown = sorted(_calls(path) & OUTPUT_CALLS)
        assert not shown, f"{name} calls {shown}: output belongs to nodectl/cli/"
        text = path.read_text()
        assert "sys.stdout" not in text and "sys.stderr" not in text, f"{name} writes to the terminal"


def test_no_code_is_loaded_by_path():
    """Node code the controller shares (the redaction rules, the recipe, the bucket client) is imported through
    nodectl.resources, so an import shows the dependency; what travels to a node is sent, never executed here."""
    for name, path in package_modules("nodectl").items():
        loads = sorted(_calls(path) & PATH_LOADS)
        assert not loads, f"{name} calls {loads}: import the module instead"


def test_every_verb_is_answered_parsed_and_called_as_its_one_declaration_says():
    """launchers/verbs.py is the one table of runctl's verbs: each declared module answers its verb with
    cmd_<verb>, each named answer type exists on the controller and parses it, and NodeClient has a method of
    each public verb's name; runctl answers no verb the table lacks, and the client calls none."""
    from nodectl.remote import answers
    from nodectl.remote.client import NodeClient
    from nodectl.resources.launchers.verbs import VERBS

    runctl = REPO / "launchers" / "runctl"
    defined = {p.stem: {n.name for n in ast.parse(p.read_text()).body if isinstance(n, ast.FunctionDef)}
               for p in runctl.glob("*.py")}
    answered = {name[len("cmd_"):] for functions in defined.values() for name in functions if name.startswith("cmd_")}
    guards = next({key.value for key in node.value.keys}
                  for node in ast.parse((runctl / "dispatch.py").read_text()).body
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "GUARDS")
    assert answered == {name.lstrip("_") for name in VERBS}, "a cmd_ function without its verb, or the reverse"
    for name, verb in VERBS.items():
        assert "cmd_" + name.lstrip("_") in defined[verb.module], f"{name}: runctl/{verb.module}.py lacks its cmd_"
        assert verb.guard in guards, f"{name}: guard {verb.guard!r} is none of runctl's ({sorted(guards)})"
        assert answers.ANSWERS[name].__name__ == verb.answer and dataclasses.is_dataclass(answers.ANSWERS[name])
    methods = {name for name in vars(NodeClient) if not name.startswith("_")} - {"workdir", "script"}
    assert methods == {name for name, verb in VERBS.items() if not verb.internal}
