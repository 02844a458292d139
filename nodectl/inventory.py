"""The inventory (docs/REFERENCE.md §1): hosts.yaml or a DeepSpeed hostfile, parsed once into frozen dataclasses.

Every problem is an `InventoryError` (exit 2) naming the file, the line, the key and what was expected; no other
exception escapes `load_inventory` for any input document.
"""
from __future__ import annotations

import ipaddress
import os
import sys
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from nodectl import container as containers, environment as environments, hostlist, outputs as stores
from nodectl.errors import InventoryError, UsageError

NODE_KEYS = {"user", "port", "identity_file", "gpus", "device", "python", "workdir", "env", "transport", "container", "environment",
             "outputs"}
TOP_KEYS = {"master_port", "defaults", "nodes", "outputs"}
HOST_RE = re.compile(r"^[A-Za-z0-9_.:%\-\[\]]+$")
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HOSTFILE_LINE_RE = re.compile(r"^(?P<host>[A-Za-z0-9_.\-\[\]%]+)(\s+slots\s*=\s*(?P<slots>\d+))?\s*$")
MAX_INVENTORY_BYTES = 8 << 20   # a hosts.yaml of 10,000 nodes with env blocks is well under 4 MB
MAX_NODES = 10_000
MAX_RANKS_PER_NODE = 1024
# What nodectl sets for every launched process; an inventory's env: may not (other NODECTL_* knobs, such as
# NODECTL_DEMO_CACHE or NODECTL_PEAK_TFLOPS, are the user's to set).
OWN_ENV = frozenset({"NODECTL_RUN_ID", "NODECTL_RUN_DIR", "NODECTL_OUTPUT_DIR", "NODECTL_NODE_RANK", "NODECTL_NNODES", "NODECTL_ATTEMPT",
                     "NODECTL_STACK_FILE", "NODECTL_METRICS"})
NAME_MAX = 128          # a node's name names files and folders on both sides (scripts/<name>.env, ...)
DEFAULT_WORKDIR = "~/nodectl"
LOCAL_WORKDIR = "~/.nodectl/local"


@dataclass(frozen=True)
class Node:
    """One machine of the inventory, with defaults already merged. `index` is its position in the file."""

    name: str
    host: str
    addr: str
    index: int
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    gpus: int | None = None          # None: as many as the node has (cuda) or 1 (cpu)
    device: str = "cuda"
    python: str = "python3"
    workdir: str = DEFAULT_WORKDIR
    env: Mapping[str, str] = field(default_factory=dict)
    transport: str = "ssh"
    container: containers.Container | None = None   # ranks run inside this image (nodectl/container.py)
    environment: environments.Environment | None = None   # ranks run in a venv nodectl builds (nodectl/environment.py)
    outputs: stores.Outputs | None = None   # where this node uploads its run's outputs (nodectl/outputs.py)
    line: int | None = None

    @property
    def is_local(self) -> bool:
        return self.transport == "local"


@dataclass(frozen=True)
class Inventory:
    nodes: tuple[Node, ...]
    source: str                      # a path, or "<built-in>"
    master_port: int | None = None
    builtin: bool = False

    @property
    def outputs(self) -> stores.Outputs | None:
        """Node 0's bucket (the run's, where every node has the same): what a launch prints and records first."""
        return self.nodes[0].outputs if self.nodes else None

    def with_outputs(self, outputs: stores.Outputs | None) -> "Inventory":
        return replace(self, nodes=tuple(replace(n, outputs=outputs) for n in self.nodes))

    def select(self, count: int | tuple[str, ...] | None = None, exclude: tuple[str, ...] = ()) -> "Inventory":
        """The first `count` nodes after dropping `exclude` (names or hosts), in node-rank order; or, where
        `count` is a tuple of names, hosts or ranges, those nodes (still in node-rank order)."""
        exclude = tuple(name for item in exclude for name in hostlist.expand(item))
        if isinstance(count, tuple):
            count = tuple(name for item in count for name in hostlist.expand(item))
        for option, names in (("--exclude", exclude), ("--nodes", count if isinstance(count, tuple) else ())):
            unknown = [x for x in names if not any(x in (n.name, n.host) for n in self.nodes)]
            if unknown:
                raise UsageError(f"{option} names no node of {self.source}: {hostlist.fold(unknown)}; "
                                 f"nodes are {hostlist.fold([n.name for n in self.nodes])}")
        if isinstance(count, tuple):
            kept = [n for n in self.nodes if (n.name in count or n.host in count)
                    and n.name not in exclude and n.host not in exclude]
            if not kept:
                raise UsageError("--nodes and --exclude leave no node")
            return replace(self, nodes=tuple(kept))
        if self.builtin and count and count > len(self.nodes):
            return builtin_inventory(count=count, template=self.nodes[0])
        kept = [n for n in self.nodes if n.name not in exclude and n.host not in exclude]
        if count is not None:
            if count < 1:
                raise UsageError(f"--nodes must be at least 1, got {count}")
            if count > len(kept):
                raise UsageError(f"--nodes {count} asked, but {self.source} has {len(kept)} usable node(s)")
            kept = kept[:count]
        return replace(self, nodes=tuple(kept))

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if name in (n.name, n.host):
                return n
        raise UsageError(f"no node named {name!r}; nodes are {', '.join(n.name for n in self.nodes)}")


def detect_local_gpus() -> int:
    """GPUs on this machine through NVML; 0 where there is no driver."""
    if os.environ.get("NODECTL_FORCE_CPU") == "1":
        return 0
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, no driver, no GPU: all mean "none"
        return 0


def builtin_inventory(count: int = 1, template: Node | None = None) -> Inventory:
    """docs/REFERENCE.md §1's default: local node(s) on this machine, cuda with every detected GPU, else one CPU rank."""
    if template is None:
        gpus = detect_local_gpus()
        template = Node(name="local0", host="localhost", addr="127.0.0.1", index=0, transport="local",
                        python=sys.executable,
                        device="cuda" if gpus else "cpu", gpus=gpus or 1, workdir=LOCAL_WORKDIR)
    nodes = tuple(replace(template, name=f"local{i}", index=i) for i in range(count))
    return Inventory(nodes=nodes, source="<built-in>", builtin=True)


def resolve_inventory_path(explicit: str | None) -> Path | None:
    """-i/--inventory, then NODECTL_INVENTORY, then ./hosts.yaml; None means the built-in default."""
    if explicit is not None and not explicit.strip():
        raise UsageError("-i/--inventory: an empty path (leave the option out to use ./hosts.yaml or this machine)")
    for candidate in (explicit, os.environ.get("NODECTL_INVENTORY")):
        if candidate:
            return Path(candidate)
    return Path("hosts.yaml") if Path("hosts.yaml").is_file() else None


def load_inventory(path: str | os.PathLike | None) -> Inventory:
    if path is None:
        return builtin_inventory()
    path = Path(path)
    try:
        if path.is_file() and path.stat().st_size > MAX_INVENTORY_BYTES:
            raise InventoryError(str(path), "file", f"{path.stat().st_size >> 20} MiB; an inventory is at most "
                                                    f"{MAX_INVENTORY_BYTES >> 20} MiB")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError(str(path), "file", "not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(str(path), "file", f"cannot be read ({exc})") from None
    return parse_inventory(text, str(path))


def parse_inventory(text: str, source: str = "hosts.yaml") -> Inventory:
    if len(text) > MAX_INVENTORY_BYTES:
        raise InventoryError(source, "file", f"an inventory is at most {MAX_INVENTORY_BYTES >> 20} MiB")
    if _looks_like_hostfile(text):
        return _parse_hostfile(text, source)
    try:
        doc = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InventoryError(source, "yaml", f"not valid YAML ({problem})",
                             mark.line + 1 if mark else None) from None
    except (ValueError, TypeError, RecursionError) as exc:  # e.g. unhashable keys, absurd nesting
        raise InventoryError(source, "yaml", f"not a usable YAML document ({exc.__class__.__name__})") from None
    return _Parser(source).inventory(doc)


ENV_ENTRY_MAX = 128 * 1024     # the kernel's MAX_ARG_STRLEN: one NAME=value string when a process starts
ENV_TOTAL_MAX = 1024 * 1024    # half of the default ARG_MAX, for everything else in a rank's environment and argv


def node_from_record(record: Mapping, source: str) -> Node:
    """A node as a run record keeps it (the plan's JSON), checked exactly as a hosts.yaml node is: a record is
    data another program or person may have written, never keyword arguments for Node. Its env is dropped (the
    record holds it redacted); its index is kept."""
    if not isinstance(record, Mapping):
        raise InventoryError(f"{source}: a node is not a mapping")
    raw = {key: value for key, value in record.items()
           if key in NODE_KEYS | {"host", "name", "addr"} and value is not None and key != "env"}
    if isinstance(raw.get("container"), Mapping):
        raw["container"] = {k: v for k, v in raw["container"].items() if k in containers.KEYS and v not in (None, ())}
    if isinstance(raw.get("environment"), Mapping):
        raw["environment"] = {k: v for k, v in raw["environment"].items()
                              if k in environments.KEYS and v is not None}
    if isinstance(raw.get("outputs"), Mapping):
        raw["outputs"] = {k: v for k, v in raw["outputs"].items() if k in stores.KEYS and v is not None}
    index = record.get("index") if isinstance(record.get("index"), int) else 0
    node = _Parser(source).node(raw, index, {}, {"nodes": [raw]})
    return replace(node, index=index)


def host_name_problem(host: str) -> str | None:
    """Why `host` cannot be a DNS name (RFC 1035: labels of at most 63, names of at most 253 characters), or
    None. Addresses and bracketed IPv6 pass."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            return f"a host name or IP address; {host!r} is neither (an IPv6 address looks like ::1 or fe80::2)"
        return None
    if host.startswith("["):
        return None
    if len(host) > 253:
        return f"a host name of at most 253 characters, got {len(host)}"
    long_labels = [label for label in host.split(".") if len(label) > 63]
    if long_labels:
        return f"a host name whose dot-separated parts are at most 63 characters ({long_labels[0][:20]}... has " \
               f"{len(long_labels[0])})"
    return None


def _looks_like_hostfile(text: str) -> bool:
    lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    return bool(lines) and all(HOSTFILE_LINE_RE.match(ln) and ":" not in ln for ln in lines) \
        and any("slots" in ln for ln in lines)


def _parse_hostfile(text: str, source: str) -> Inventory:
    nodes, seen = [], set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = HOSTFILE_LINE_RE.match(line)
        host, slots = match["host"], match["slots"]
        if host in seen:
            raise InventoryError(source, "host", f"{host!r} listed twice", number)
        if problem := host_name_problem(host) or (len(host) > NAME_MAX and f"at most {NAME_MAX} characters") or (
                host in (".", "..") and "a host name (it also names the node's folders here)"):
            raise InventoryError(source, "host", problem, number)
        if slots is not None and not 1 <= int(slots) <= MAX_RANKS_PER_NODE:
            raise InventoryError(source, "slots", f"an integer 1-{MAX_RANKS_PER_NODE}", number)
        seen.add(host)
        nodes.append(Node(name=host, host=host, addr=host, index=len(nodes),
                          gpus=int(slots) if slots else None, line=number))
    return Inventory(nodes=tuple(nodes), source=source)


class _LineMap(dict):
    """A mapping that remembers the line of each key, for error messages."""

    line: int | None = None
    key_lines: dict


class _LineLoader(yaml.SafeLoader):
    def construct_line_map(self, node):
        data = _LineMap()
        data.line = node.start_mark.line + 1
        data.key_lines = {}
        yield data
        data.update(self.construct_mapping(node))
        for key_node, _ in node.value:
            key = self.construct_object(key_node)
            if isinstance(key, (str, int, float, bool)) or key is None:
                data.key_lines[key] = key_node.start_mark.line + 1


_LineLoader.add_constructor("tag:yaml.org,2002:map", _LineLoader.construct_line_map)


class _Parser:
    """Checks the document's shape and types, collecting nothing: the first problem is raised."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, expected: str, container: Any = None, name: Any = None) -> None:
        line = None
        if isinstance(container, _LineMap):
            line = container.key_lines.get(name, container.line) if name is not None else container.line
        raise InventoryError(self.source, key, expected, line)

    def inventory(self, doc: Any) -> Inventory:
        if not isinstance(doc, dict):
            self.fail("document", "a mapping with a 'nodes:' list (or a hostfile of 'host slots=N' lines)")
        for key in doc:
            if key not in TOP_KEYS:
                self.fail(str(key), f"unknown key; expected one of {', '.join(sorted(TOP_KEYS))}", doc, key)
        master_port = self.port(doc.get("master_port"), "master_port", doc) if "master_port" in doc else None
        defaults = doc.get("defaults") or {}
        if not isinstance(defaults, dict):
            self.fail("defaults", "a mapping of node settings", doc, "defaults")
        for key in defaults:
            if key not in NODE_KEYS:
                hint = " (host, name and addr belong to each node)" if key in ("host", "name", "addr") else ""
                self.fail(f"defaults.{key}", f"unknown key{hint}; expected one of {', '.join(sorted(NODE_KEYS))}",
                          defaults, key)
        self.settings(defaults, "defaults")
        raw_nodes = doc.get("nodes")
        if not isinstance(raw_nodes, list) or not raw_nodes:
            self.fail("nodes", "a non-empty list of nodes, each with a 'host:'", doc, "nodes")
        if len(raw_nodes) > MAX_NODES:
            self.fail("nodes", f"at most {MAX_NODES} nodes, got {len(raw_nodes)}", doc, "nodes")
        raw_nodes = [one for index, raw in enumerate(raw_nodes) for one in self.expand(raw, index, doc)]
        if len(raw_nodes) > MAX_NODES:
            self.fail("nodes", f"at most {MAX_NODES} nodes, got {len(raw_nodes)} once ranges are expanded", doc,
                      "nodes")
        nodes, names = [], set()
        for index, raw in enumerate(raw_nodes):
            node = self.node(raw, index, defaults, doc)
            if node.name in names:
                self.fail(f"nodes[{index}].name", f"duplicate node name {node.name!r}", raw, "name")
            names.add(node.name)
            nodes.append(node)
        # a top-level outputs: is every node's unless it (or defaults:) sets its own
        outputs = stores.parse(doc.get("outputs"), "outputs", lambda key, expected: self.fail(key, expected, doc, "outputs"))
        if outputs is not None:
            nodes = [node if node.outputs is not None or "outputs" in defaults else replace(node, outputs=outputs)
                     for node in nodes]
        return Inventory(nodes=tuple(nodes), source=self.source, master_port=master_port)

    def expand(self, raw: Any, index: int, doc: dict) -> list[Any]:
        """`host: gpu[01-16]` is sixteen nodes; `name:` and `addr:` then hold a range of the same length (or are
        left out). Each copy keeps the entry's line numbers for later messages."""
        for key in ("host", "addr"):   # [::1]: an IPv6 address in brackets, not a range
            value = raw.get(key) if isinstance(raw, dict) else None
            if isinstance(value, str) and value.startswith("[") and value.endswith("]") and ":" in value:
                raw[key] = value[1:-1]
        ranged = [key for key in ("host", "name", "addr") if isinstance(raw, dict) and isinstance(raw.get(key), str)
                  and "[" in raw[key]]
        if not ranged:
            return [raw]
        lists = {}
        for key in ranged:
            try:
                lists[key] = hostlist.expand(raw[key])
            except UsageError as exc:
                self.fail(f"nodes[{index}].{key}", str(exc), raw, key)
        count = len(lists[ranged[0]])
        for key, names in lists.items():
            if len(names) != count:
                self.fail(f"nodes[{index}].{key}", f"a range of {count} names like {ranged[0]}'s, got {len(names)}",
                          raw, key)
        copies = []
        for i in range(count):
            copy = _LineMap(raw)
            copy.line, copy.key_lines = getattr(raw, "line", None), getattr(raw, "key_lines", {})
            copy.update({key: names[i] for key, names in lists.items()})
            copies.append(copy)
        return copies

    def node(self, raw: Any, index: int, defaults: dict, doc: dict) -> Node:
        where = f"nodes[{index}]"
        if not isinstance(raw, dict):
            self.fail(where, "a mapping with at least 'host:'", doc, "nodes")
        for key in raw:
            if key not in NODE_KEYS | {"host", "name", "addr"}:
                allowed = ", ".join(sorted(NODE_KEYS | {"host", "name", "addr"}))
                self.fail(f"{where}.{key}", f"unknown key; expected one of {allowed}", raw, key)
        host = raw.get("host")
        if not isinstance(host, str) or not HOST_RE.match(host):
            self.fail(f"{where}.host", "a host name, address or ~/.ssh/config alias "
                      "(letters, digits, '.', '-', '_', ':')", raw, "host" if "host" in raw else None)
        if problem := host_name_problem(host):
            self.fail(f"{where}.host", problem, raw, "host")
        name = raw.get("name", host)
        if "name" not in raw and ":" in host:
            self.fail(f"{where}.name", f"a name for this node: its host {host} is an IPv6 address, which cannot name "
                      f"its folders (name: node0)", raw, "host")
        if not isinstance(name, str) or not NAME_RE.match(name) or len(name) > NAME_MAX or name in (".", ".."):
            self.fail(f"{where}.name", f"a label of letters, digits, '.', '-' and '_' (not . or ..), at most {NAME_MAX} "
                      f"characters", raw, "name")
        addr = raw.get("addr", host)
        if not isinstance(addr, str) or not HOST_RE.match(addr) or host_name_problem(addr):
            self.fail(f"{where}.addr", host_name_problem(addr) if isinstance(addr, str) and HOST_RE.match(addr)
                      else "a host name or IP address other nodes can reach", raw, "addr")
        settings = self.settings(defaults, "defaults") | self.settings(raw, where)
        env = {**self.settings(defaults, "defaults").get("env", {}), **self.settings(raw, where).get("env", {})}
        settings["env"] = env
        raw_container = containers.merge(defaults.get("container"), raw["container"]) if "container" in raw \
            else defaults.get("container")
        settings["container"] = containers.parse(raw_container, f"{where}.container",
                                                 lambda key, expected: self.fail(key, expected, raw, "container"))
        if settings.get("environment") is not None:
            settings["environment"] = environments.parse(settings["environment"], f"{where}.environment",
                                                         lambda key, expected: self.fail(key, expected, raw))
        if settings["container"] is not None and settings.get("environment") is not None:
            self.fail(f"{where}.environment", "not beside container: (an image brings its own environment); set one "
                      "of the two for this node (environment: null turns a default off)", raw,
                      "environment" if "environment" in raw else "container")
        node = Node(name=name, host=host, addr=addr, index=index, line=getattr(raw, "line", None), **settings)
        if node.is_local and "workdir" not in raw and "workdir" not in defaults:
            node = replace(node, workdir=LOCAL_WORKDIR)
        if node.is_local and "python" not in raw and "python" not in defaults:
            node = replace(node, python=sys.executable)  # this machine: the interpreter nodectl runs in
        return node

    def settings(self, raw: dict, where: str) -> dict:
        """The per-node settings in `raw` (defaults or one node), checked and typed."""
        out: dict[str, Any] = {}
        for key in NODE_KEYS & raw.keys():
            value, label = raw[key], f"{where}.{key}"
            if key == "port":
                out[key] = self.port(value, label, raw, key)
            elif key == "gpus":
                if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS_PER_NODE:
                    self.fail(label, f"an integer 1-{MAX_RANKS_PER_NODE} (ranks per node), got {value!r}", raw, key)
                out[key] = value
            elif key == "device":
                if value not in ("cuda", "cpu"):
                    self.fail(label, f"'cuda' or 'cpu', got {value!r}", raw, key)
                out[key] = value
            elif key == "transport":
                if value not in ("ssh", "local"):
                    self.fail(label, f"'ssh' or 'local', got {value!r}", raw, key)
                out[key] = value
            elif key == "env":
                out[key] = self.env(value, label, raw)
            elif key == "environment":
                environments.parse(value, label, lambda k, expected: self.fail(k, expected, raw, key))
                out[key] = value
            elif key == "outputs":
                out[key] = stores.parse(value, label, lambda k, expected: self.fail(k, expected, raw, key))
            elif key == "container":
                if isinstance(value, dict) and "image" in value or isinstance(value, str):
                    containers.parse(value, label, lambda k, expected: self.fail(k, expected, raw, key))
                out[key] = value
            else:  # user, identity_file, python, workdir: plain one-line strings
                if not isinstance(value, str) or not value.strip() or any(c in value for c in "\n\r\0"):
                    self.fail(label, f"a non-empty one-line string, got {value!r}", raw, key)
                if key == "workdir" and not (value.startswith("/") or value == "~" or value.startswith("~/")):
                    self.fail(label, f"an absolute path or one in the login user's home (~/...), got {value!r} (a "
                              f"relative path would depend on where each command starts; ~user is not supported)",
                              raw, key)
                out[key] = value
        return out

    def env(self, value: Any, label: str, parent: dict) -> dict[str, str]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.fail(label, "a mapping of NAME: value", parent, "env")
        env = {}
        for name, item in value.items():
            if not isinstance(name, str) or not ENV_NAME_RE.match(name):
                self.fail(f"{label}.{name}", "an environment variable name ([A-Za-z_][A-Za-z0-9_]*)", value, name)
            if name.upper() in OWN_ENV:
                self.fail(f"{label}.{name}", f"a name nodectl does not set itself ({', '.join(sorted(OWN_ENV))} are "
                          "how it tells a run's processes apart: a rank given another run's id could not be stopped)",
                          value, name)
            if isinstance(item, (dict, list)) or item is None or (isinstance(item, str) and "\0" in item):
                self.fail(f"{label}.{name}", "a string or number", value, name)
            env[name] = str(item).lower() if isinstance(item, bool) else str(item)
            if len(name) + 1 + len(env[name].encode("utf-8", "surrogateescape")) >= ENV_ENTRY_MAX:
                self.fail(f"{label}.{name}", "a value under 128 KiB: Linux refuses to start a process with a longer "
                          "variable (MAX_ARG_STRLEN), so no rank would start; put it in a file on the nodes and "
                          "name the file", value, name)
        if sum(len(k) + len(v) + 2 for k, v in env.items()) >= ENV_TOTAL_MAX:
            self.fail(label, f"variables under {ENV_TOTAL_MAX // 1024} KiB in all: with the rest of a rank's "
                      f"environment and arguments they must fit the kernel's limit (ARG_MAX, 2 MiB by default)",
                      parent, "env")
        return env

    def port(self, value: Any, label: str, parent: dict, key: str | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            self.fail(label, f"a TCP port number 1-65535, got {value!r}", parent, key or label)
        return value
