"""Network checks: InfiniBand ports and HCAs, GPUDirect RDMA, the interfaces NCCL and gloo are told to use,
node 0's master port, every node's way to it. Pure functions of the probe report and runctl's answers."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Mapping

from nodectl.preflight.checks import MEASURED, check
from nodectl.probe_report import IbDevice, IbPort, ProbeReport
from nodectl.preflight.verdict import FAIL, PASS, SKIP, WARN, CheckResult, result

SOCKET_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


VIRTUAL_PREFIXES = ("docker", "veth", "virbr", "br-", "lo", "cni", "flannel", "cali", "tun", "tap")


IB_RATE = re.compile(r"([\d.]+)\s*Gb/sec")


@dataclass(frozen=True)
class NameList:
    """An NCCL name list as NCCL reads NCCL_SOCKET_IFNAME and NCCL_IB_HCA (gloo's GLOO_SOCKET_IFNAME likewise):
    comma-separated prefixes, `=` before the list for exact names, `^` before it to exclude what it names, and
    `name:port` entries for HCA ports."""

    exclude: bool
    exact: bool
    entries: tuple[tuple[str, int | None], ...]

    def names(self, name: str, port: int | None = None) -> list[tuple[str, int | None]]:
        """The entries that name this interface (or HCA port)."""
        return [(want, p) for want, p in self.entries if (name == want if self.exact else name.startswith(want))
                and (p is None or port is None or p == port)]

    def selects(self, name: str, port: int | None = None) -> bool:
        return bool(self.names(name, port)) != self.exclude


def parse_name_list(value: str) -> NameList:
    value = value.strip()
    exclude = value.startswith("^")
    value = value.lstrip("^")
    exact = value.startswith("=")
    entries = []
    for part in value.lstrip("=").split(","):
        name, _, port = part.strip().partition(":")
        if name:
            entries.append((name, int(port) if port.isdigit() else None))
    return NameList(exclude, exact, tuple(entries))


def ib_ports(report: ProbeReport) -> list[tuple[IbDevice, IbPort]]:
    return [(d, p) for d in report.infiniband for p in d.ports]


def ib_rate(port: IbPort) -> float | None:
    match = IB_RATE.search(port.rate or "")
    return float(match[1]) if match else None


@check("infiniband", "network", cuda_only=True,
       doc=(("infiniband",
            "`/sys/class/infiniband/*/ports/*` state, phys state, rate, link layer",
            "fail when a port is down",
            "-"),))
def check_infiniband(node: str, report: ProbeReport) -> CheckResult:
    if report.infiniband_error:  # the devices could not be listed
        return result(node, SKIP, f"InfiniBand devices could not be read ({report.infiniband_error})")
    if not report.infiniband:
        return result(node, SKIP, "no InfiniBand/RoCE device")
    ports = [(d.name, p) for d, p in ib_ports(report)]
    down = [f"{name}/{p.port} {p.state} {p.phys_state}" for name, p in ports
            if "ACTIVE" not in (p.state or "") or "LinkUp" not in (p.phys_state or "")]
    if down:
        return result(node, FAIL, "ports not ACTIVE/LinkUp: " + "; ".join(down),
                      "check cables and the subnet manager (ibstat; systemctl status opensm); list only "
                      "working HCAs with NCCL_IB_HCA")
    rates = sorted({str(p.rate) for _, p in ports})
    layers = sorted({str(p.link_layer) for _, p in ports})
    return result(node, PASS, f"{len(ports)} port(s) up, {', '.join(map(str, rates))}, "
                              f"{'/'.join(map(str, layers))}")


@check("ib errors", "network", cuda_only=True,
       doc=(("ib errors",
            "`ports/*/counters/` symbol_error, link_error_recovery, link_downed, port_rcv_errors, "
            "local_link_integrity_errors, excessive_buffer_overrun_errors, port_rcv_remote_physical_errors",
            "warn on any non-zero count",
            "counts since the driver loaded; `perfquery -x`"),))
def check_ib_errors(node: str, report: ProbeReport) -> CheckResult:
    ports = ib_ports(report)
    if not ports:
        return result(node, SKIP, "no InfiniBand/RoCE port")
    counted = [(d, p, p.counters) for d, p in ports if p.counters is not None]
    if not any(c for _, _, c in counted):
        return result(node, SKIP, "port error counters not readable")
    errors = [f"{d.name}/{p.port} " + ", ".join(f"{k} {v}" for k, v in c.items() if v)
              for d, p, c in counted if any(c.values())]
    if errors:
        return result(node, WARN, "; ".join(errors[:6]),
                      "counts since the driver loaded: clear them (perfquery -x -R) and check again after a "
                      "collective; rising symbol or receive errors mean a bad cable or transceiver")
    return result(node, PASS, f"no errors counted on {len(counted)} port(s)")


@check("ib hca", "network", given=lambda f: (f.report, f.env), cuda_only=True,
       doc=(("ib hca",
            "`NCCL_IB_HCA` from the inventory's env (`^` exclude, `=` exact, `name:port`) vs the ports and their "
            "state",
            "fail when an entry names no port, a port that is not ACTIVE, or an exclusion leaves none; the hint "
            "lists the active ports",
            "NCCL's environment variable docs"),))
def check_ib_hca(node: str, report: ProbeReport, env: Mapping[str, str]) -> CheckResult:
    value = (env or {}).get("NCCL_IB_HCA")
    if not value:
        return result(node, PASS, "NCCL_IB_HCA not set (NCCL uses every active HCA)")
    reason = report.unreadable("infiniband")
    if reason:
        return result(node, SKIP, reason)
    ports = {(d.name, p.port): "ACTIVE" in (p.state or "") for d, p in ib_ports(report)}
    active = sorted({f"{name}:{port}" for (name, port), up in ports.items() if up})
    wanted = parse_name_list(value)
    if wanted.exclude:
        if not any(up for (name, port), up in ports.items() if wanted.selects(name, port)):
            return result(node, FAIL, f"NCCL_IB_HCA={value} leaves no active port",
                          f"active ports: {', '.join(active) or 'none'}")
        return result(node, PASS, f"NCCL_IB_HCA={value}")
    problems = []
    for name, port in wanted.entries:
        hits = [k for k in ports if (name, port) in wanted.names(*k)]
        if not hits:
            problems.append(f"no {name}{f':{port}' if port else ''} on the node")
        elif not any(ports[k] for k in hits):
            problems.append(f"{name}{f':{port}' if port else ''} is not ACTIVE")
    if problems:
        return result(node, FAIL, f"NCCL_IB_HCA={value}: " + "; ".join(problems),
                      f"name active ports in the inventory's env: ({', '.join(active) or 'none active'})")
    return result(node, PASS, f"NCCL_IB_HCA={value}")


@check("socket ifname", "network", given=lambda f: (f.report, f.env),
       doc=(("socket ifname",
            "`NCCL_SOCKET_IFNAME` / `GLOO_SOCKET_IFNAME` from the inventory's `env:`, against `/sys/class/net` "
            "(operstate)",
            "fail when the value matches no interface (prefix, `=exact`, `^exclude` as NCCL reads it) or only "
            "interfaces that are down; the hint lists the ones up",
            "NCCL's environment variable docs"),))
def check_socket_ifname(node: str, report: ProbeReport, env: Mapping[str, str]) -> CheckResult:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME from the inventory's env must name an interface the node has, and
    it must be up: a wrong name makes NCCL fail at init ("no socket interface found") and gloo hang or fail."""
    named = {var: env[var] for var in SOCKET_IFNAME_VARS if env.get(var)}
    if not named:
        return result(node, PASS, "not set (NCCL and gloo choose)")
    reason = report.unreadable("nics")
    if reason:
        return result(node, SKIP, reason)
    nics = {n.name: n for n in report.nics if n.name}
    up = sorted(name for name, nic in nics.items() if nic.state in ("up", "unknown"))
    problems = []
    for var, value in named.items():
        wanted = parse_name_list(value)
        chosen = [name for name in nics if wanted.selects(name)]
        missing = [] if wanted.exclude else [want for want, _ in wanted.entries
                                             if not any((want, None) in wanted.names(name) for name in nics)]
        if missing:
            problems.append(f"{var}={value}: no interface {', '.join(missing)} on the node")
        elif not [n for n in chosen if n in up]:
            problems.append(f"{var}={value}: {', '.join(chosen)} is down")
    if problems:
        return result(node, FAIL, "; ".join(problems),
                      f"set it in the inventory's env: to an interface that is up there: {', '.join(up)}")
    return result(node, PASS, ", ".join(f"{var}={value}" for var, value in named.items()))


@check("master port", "network", given=lambda f: (f.extras["port"],), needs="port",
       doc=(("master port",
            "node 0 binds the master port (SO_REUSEADDR, like torch's TCPStore)",
            "fail when in use",
            "-"),))
def check_master_port(node: str, port_answer: Mapping | None) -> CheckResult:
    if port_answer is None:
        return result(node, SKIP, "not node 0")
    if port_answer.get("free"):
        return result(node, PASS, f"port {port_answer['port']} free")
    return result(node, FAIL, f"port {port_answer.get('asked')} is in use on node 0",
                  "stop what holds it or set another master_port: in hosts.yaml")


@check("reach master", "network", needs="reach",
       given=lambda f: (f.extras["reach"], f"{f.expect.master_addr}:{f.expect.master_port}", f.extras.get("master_name")),
       doc=(("reach master",
            "every node opens a TCP connection to node 0's master port (a listener is started for the test)",
            "fail with the error; where the node resolves node 0's name to none of its addresses, the fix is "
            "that entry, not the firewall",
            "-"),))
def check_reach_master(node: str, answer: Mapping | None, target: str, name: Mapping | None = None) -> CheckResult:
    if answer is None:
        return result(node, SKIP, "not tested")
    if answer.get("ok"):
        return result(node, PASS, f"{target} in {answer.get('ms', 0):.0f} ms")
    if name and check_master_name(node, name).verdict == FAIL:
        found = name.get("resolved")
        shown = ", ".join(found) if isinstance(found, (list, tuple)) and found else "nothing"
        return result(node, FAIL, f"cannot open {target} (resolved on {node} to {shown}): {answer.get('error')}",
                      f"{node} resolves {name.get('name')} wrongly: see the master name check")
    return result(node, FAIL, f"cannot open {target}: {answer.get('error')}",
                  "open the master port on node 0's firewall to the other nodes, or set addr: of node 0 to "
                  "an address they can reach")


@check("peer ports", "network", given=lambda f: (f.extras["peer_ports"],), needs="peer_ports",
       doc=(("peer ports",
            "a listener on a port from the node's ephemeral range (`net.ipv4.ip_local_port_range`, where gloo and "
            "NCCL listen for the other ranks), and a TCP connection to it from every other node",
            "fail when another node cannot connect, naming the nodes, the port, the error and the range to open",
            "a firewall that lets SSH and the master port in but not the ephemeral ports: the rendezvous works, "
            "then the collective fails with the connecting rank blamed"),))
def check_peer_ports(node: str, answer: Mapping) -> CheckResult:
    reached = answer.get("from") or {}
    if not reached:
        return result(node, SKIP, "no other node tried to connect")
    port, span = answer.get("port"), answer.get("range")
    failed = {peer: a for peer, a in reached.items() if not a.get("ok")}
    if not failed:
        return result(node, PASS, f"port {port} reached from {', '.join(sorted(reached))}")
    said = "; ".join(f"{peer}: {a.get('error')}" for peer, a in sorted(failed.items())[:4])
    ports = f"{span[0]}-{span[1]}" if span and len(span) == 2 else "32768-60999"
    worked = sorted(set(reached) - set(failed))
    also = f" ({', '.join(worked)} could)" if worked else ""
    return result(node, FAIL,
                  f"{'the other nodes' if not worked else ', '.join(sorted(failed))} cannot connect to {node}'s "
                  f"port {port}, from its ephemeral range where gloo and NCCL listen{also}: {said}",
                  f"open TCP ports {ports} (net.ipv4.ip_local_port_range) on {node} to the other nodes, e.g. "
                  f"iptables -I INPUT -p tcp -s <the nodes' subnet> --dport {ports.replace('-', ':')} -j ACCEPT "
                  f"(NODE_SETUP.md, section 4)")


@check("master name", "network", given=lambda f: (f.extras["master_name"],), needs="master_name",
       doc=(("master name",
            "node 0's `addr:` when it is a host name: the addresses each other node resolves it to, against node "
            "0's own interface addresses",
            "fail when a node resolves it to none of node 0's addresses (a stale /etc/hosts entry or DNS record), "
            "naming the line",
            "every rank connects to MASTER_ADDR as its node resolves it: a stale entry on one node sends its "
            "ranks elsewhere and the rendezvous times out"),))
def check_master_name(node: str, answer: Mapping) -> CheckResult:
    name, found, master = answer.get("name"), answer.get("resolved"), answer.get("master") or "node 0"
    has = [a for a in answer.get("master_has") or () if not str(a).startswith(("127.", "::1"))]
    if isinstance(found, Mapping):
        return result(node, FAIL, f"{name} ({master}'s addr:) does not resolve on {node}: {found.get('error')}",
                      f"add `<{master}'s address> {name}` to /etc/hosts on {node}, or set addr: of {master} to "
                      f"its address")
    if not found or not has:
        return result(node, SKIP, f"{master}'s addresses are unknown" if found else f"{name} was not resolved")
    if set(found) & set(has):
        return result(node, PASS, f"{name} -> {', '.join(found)}")
    line = answer.get("line")
    where = f" (/etc/hosts line {line['line']}: {line['text']!r})" if isinstance(line, Mapping) else ""
    return result(node, FAIL,
                  f"{node} resolves {name} ({master}'s addr:) to {', '.join(found)}{where}, none of {master}'s "
                  f"addresses ({', '.join(has)}): its ranks would look for the master elsewhere",
                  f"correct the stale entry for {name} on {node}{' (that /etc/hosts line)' if where else ''} to "
                  f"{has[0]}, or set addr: of {master} to {has[0]}")


@check("interface", "network", given=lambda f: (f.extras["route"], f.expect.master_addr), needs="route",
       doc=(("interface",
            "the route each node takes toward the master address",
            "recommends `NCCL_SOCKET_IFNAME`/`GLOO_SOCKET_IFNAME` for that device; warns on a virtual bridge",
            "-"),))
def check_route(node: str, answer: Mapping | None, master_addr: str) -> CheckResult:
    """The interface a node uses toward the master address; docker, virtual or lo is usually a wrong pick."""
    if not answer or not answer.get("dev"):
        return result(node, SKIP, "route unknown")
    dev = answer["dev"]
    loopback_master = master_addr.startswith("127.") or master_addr in ("localhost", "::1")
    if dev.startswith(VIRTUAL_PREFIXES) and not loopback_master:
        return result(node, WARN, f"{master_addr} is reached through {dev}",
                      "pin the right NIC for NCCL and gloo", {"NCCL_SOCKET_IFNAME": "<your NIC>",
                                                 "GLOO_SOCKET_IFNAME": "<your NIC>"})
    return result(node, PASS, f"{dev} toward {master_addr}",
                  env=None if loopback_master else {"NCCL_SOCKET_IFNAME": dev, "GLOO_SOCKET_IFNAME": dev})


# ---- the all-reduce job and the node-pair tests (launchers/collective.py) ----------------------------------

TRANSPORT_RE = re.compile(r"via (P2P/[\w/]+|SHM/[\w/]+|NET/IB[\w/]*|NET/Socket[\w/]*|NET/[\w/]+|NVLS[\w/]*|"
                          r"CollNet[\w/]*)")


def transports_in(log: str) -> dict[str, int]:
    """How many NCCL connections used each transport: {"P2P/CUMEM/read": 24, "NET/IB/0/GDRDMA": 8, ...}."""
    counts: dict[str, int] = {}
    for match in TRANSPORT_RE.finditer(log):
        counts[match[1]] = counts.get(match[1], 0) + 1
    return counts


def result_in(log: str) -> dict | None:
    for line in reversed(log.splitlines()):
        if line.startswith("NODECTL_COLLECTIVE "):
            try:
                found = json.loads(line.split(" ", 1)[1])
            except (ValueError, RecursionError):   # a line cut short, or a hostile one: no result
                return None
            return found if isinstance(found, dict) else None
    return None


# "Connection refused, remote=[127.0.1.1]:41234" (gloo), "... to 10.0.0.12<41234>" (NCCL's socket transport)
REMOTE_RE = re.compile(r"remote=\[?([0-9A-Fa-f:.]+?)\]?:\d+|(\d{1,3}(?:\.\d{1,3}){3})<\d+>")


@dataclass(frozen=True, kw_only=True)
class AddressOwner:
    """A node an address in a failed collective belongs to, and what makes it that node's."""
    node: str
    how: str            # "addr", "hostname" or "interface"
    said: str           # in words, for the verdict


def address_owners(nodes, reports: Mapping[str, ProbeReport]) -> dict[str, list[AddressOwner]]:
    """{address: the nodes it belongs to}: a node's inventory `addr:`, the addresses its host name resolves to
    (what gloo binds and advertises) and its interfaces' (not loopback ones)."""
    owners: dict[str, list[AddressOwner]] = {}

    def add(address: str, owner: AddressOwner) -> None:
        known = owners.setdefault(str(address).split("/")[0], [])
        if all(o.node != owner.node for o in known):
            known.append(owner)

    for node in nodes:
        add(node.addr, AddressOwner(node=node.name, how="addr", said=f"{node.name}'s addr:"))
        report = reports.get(node.name)
        if report is None:
            continue
        found = report.os.hostname_resolves
        if isinstance(found, tuple) and found:
            line = report.os.hosts_line
            where = f" (/etc/hosts line {line.line}: {line.text!r})" if line is not None else ""
            add(found[0], AddressOwner(node=node.name, how="hostname",
                                       said=f"what {node.name}'s host name {report.os.hostname} resolves to{where}"))
        for nic in report.nics:
            for address in nic.addresses:
                if not str(address).startswith(("127.", "::1")):
                    add(address, AddressOwner(node=node.name, how="interface",
                                              said=f"an address of {node.name}'s {nic.name}"))
    return owners


def culprit_of(failure: str, owners: Mapping[str, list[AddressOwner]]) -> CheckResult | None:
    """The node a failed collective's error points at: the one the remote address it could not connect to belongs
    to, with the cause and the fix; None when the error names no address, or one no single node owns."""
    for match in REMOTE_RE.finditer(failure):
        address = match[1] or match[2]
        found = owners.get(address) or []
        if len(found) != 1:
            continue
        owner = found[0]
        if owner.how == "hostname" and address.startswith(("127.", "::1")):
            return CheckResult("collective", owner.node, FAIL,
                               f"the all-reduce job failed connecting to {address}, {owner.said}: gloo advertised "
                               f"it to the other ranks, which cannot reach {owner.node} there: {failure}",
                               f"on {owner.node}, map its host name to its addr: in /etc/hosts instead of "
                               f"{address}, or set GLOO_SOCKET_IFNAME in the inventory's env:")
        return CheckResult("collective", owner.node, FAIL,
                           f"the all-reduce job failed connecting to {address}, {owner.said}: {failure}",
                           f"{owner.node} does not accept connections from the other nodes on that port: open "
                           f"its ephemeral range (net.ipv4.ip_local_port_range) to them in its firewall "
                           f"(NODE_SETUP.md, section 4), or check that the address is right")
    return None


@check("collective, nccl transport", "network", scope="job", tiers=MEASURED,
       doc=(("collective",
            "an all-reduce job through the launch path: sums checked, busbw 1 MiB .. 1 GiB (GPU) or 64 MiB (CPU); "
            "NCCL transports from `NCCL_DEBUG=INFO`",
            "fail on wrong sums, a failed job, or sockets while InfiniBand is present; warn when NCCL uses "
            "InfiniBand without GDRDMA; a failed job is named on the node that owns the address the failing rank "
            "could not connect to (its `addr:`, an interface's, or what its host name resolves to), with the fix",
            "-"),))
def judge_collective(result: dict | None, transports: dict[str, int], ib_present: bool, nnodes: int,
                     failure: str | None, run_id: str | None = None,
                     owners: Mapping[str, list[AddressOwner]] | None = None) -> list[CheckResult]:
    """The all-reduce job's verdicts. A failure is blamed on the node that owns the address the failing rank
    could not connect to (`owners`, from address_owners), not on the rank that reported it."""
    named = culprit_of(failure, owners) if failure and owners else None
    if named is not None:
        return [named]
    if failure or result is None:
        return [CheckResult("collective", "cluster", FAIL, f"the all-reduce job failed: {failure or 'no result'}",
                            f"see every rank's log with nodectl tail all --run {run_id or 'RUN'} (NCCL_DEBUG=INFO "
                            f"is set there); a peer that cannot be reached on its ephemeral ports while the master "
                            f"port works is a firewall between the nodes (NODE_SETUP.md, section 4)")]
    wrong = [s["bytes"] for s in result["sizes"] if not s["ok"]]
    out = []
    if wrong:
        out.append(CheckResult("collective", "cluster", FAIL, f"all-reduce returned wrong sums at {wrong[:3]} bytes",
                               "a GPU or link corrupts data: run preflight --full to find the node pair"))
    else:
        largest = result["sizes"][-1]
        out.append(CheckResult("collective", "cluster", PASS,
                               f"{result['backend']} all-reduce correct on {result['world']} ranks; busbw "
                               f"{largest['busbw_gbs']:.1f} GB/s at {largest['bytes'] >> 20} MiB"))
    if transports:
        used = ", ".join(f"{name} x{count}" for name, count in sorted(transports.items()))
        socket = any(name.startswith("NET/Socket") for name in transports)
        if ib_present and socket and nnodes > 1:
            out.append(CheckResult("nccl transport", "cluster", FAIL, f"InfiniBand is present but NCCL used {used}",
                                   "NCCL fell back to TCP sockets: make sure NCCL_IB_DISABLE is unset or 0, name "
                                   "the HCAs with NCCL_IB_HCA, load nvidia-peermem for GPUDirect RDMA",
                                   {"NCCL_IB_DISABLE": "0"}))
        elif socket and nnodes > 1:
            out.append(CheckResult("nccl transport", "cluster", WARN, used, "inter-node traffic on TCP sockets"))
        elif any(name.startswith("NET/IB") for name in transports) and not any("GDRDMA" in n for n in transports):
            out.append(CheckResult("nccl transport", "cluster", WARN, f"{used}: InfiniBand without GPUDirect RDMA",
                                   "every message is staged through host memory: load nvidia_peermem (modprobe "
                                   "nvidia_peermem), or use the open kernel modules for DMA-BUF; NCCL then shows "
                                   "NET/IB/<n>/GDRDMA"))
        else:
            out.append(CheckResult("nccl transport", "cluster", PASS, used))
    return out


SLOW_PAIR = 0.7


@check("node pairs", "network", scope="job", tiers=("full",),
       doc=(("node pairs (`--full`, 3+ nodes)",
            "the same job on each neighbour pair",
            "warn on pairs under 70% of the median, naming the node common to the slow pairs",
            "-"),))
def judge_pairs(pairs: list[dict]) -> list[CheckResult]:
    """Pairs well under the median busbw point at a slow node: the one that is in every slow pair."""
    measured = [p for p in pairs if p.get("busbw_gbs")]
    failed = [p for p in pairs if not p.get("busbw_gbs")]
    out = [CheckResult("node pair", "cluster", FAIL, f"{'+'.join(p['nodes'])}: {p.get('error')}",
                       "run a two-node launch on that pair to see its logs") for p in failed]
    if len(measured) < 2:
        return out
    median = sorted(p["busbw_gbs"] for p in measured)[len(measured) // 2]
    slow = [p for p in measured if p["busbw_gbs"] < SLOW_PAIR * median]
    detail = "; ".join(f"{'+'.join(p['nodes'])} {p['busbw_gbs']:.1f} GB/s" for p in measured)
    if not slow:
        return out + [result("cluster", PASS, detail)]
    suspects = set(slow[0]["nodes"]).intersection(*(set(p["nodes"]) for p in slow))
    culprit = ", ".join(sorted(suspects)) or "no single node"
    return out + [result("cluster", WARN, f"slow pairs (under {SLOW_PAIR:.0%} of the median "
                                          f"{median:.1f} GB/s): {detail}; common node: {culprit}",
                         f"check {culprit}'s NIC, cabling and PCIe; or leave it out with --exclude")]


@check("socket route", "network", given=lambda f: (f.env, f.extras["route"], f.report), needs="route",
       doc=(("socket route",
            "the device each node's route to every other node uses (`ip route get <peer>`), against "
            "`NCCL_SOCKET_IFNAME` / `GLOO_SOCKET_IFNAME` from the inventory's `env:`",
            "fail when a route to another node leaves through an interface the setting does not select (a "
            "container bridge that is up, say), naming the interface and the device the route really uses",
            "NCCL and gloo bind their sockets to the named interface: traffic to a peer it does not route to "
            "hangs or fails at init"),))
def check_socket_route(node: str, env: Mapping[str, str], answer: Mapping | None,
                       report: ProbeReport | None = None) -> CheckResult:
    nics = [n.name for n in (report.nics if report is not None else ()) if n.name]
    named = {var: env[var] for var in SOCKET_IFNAME_VARS if env.get(var)
             and (not nics or any(parse_name_list(env[var]).selects(name) for name in nics))}   # else: socket ifname's
    peers = (answer or {}).get("peers") or {}
    if not named:
        return result(node, PASS, "no socket interface named")
    if not peers:
        return result(node, SKIP, "no route to another node was read (one node, or no `ip`)")
    problems = []
    for var, value in named.items():
        wanted = parse_name_list(value)
        astray = {peer: dev for peer, dev in peers.items() if dev and not wanted.selects(dev)}
        if astray:
            shown = ", ".join(f"{peer} through {dev}" for peer, dev in sorted(astray.items())[:4])
            problems.append(f"{var}={value}, but the route to {shown} does not use it")
    if problems:
        devices = sorted({dev for dev in peers.values() if dev})
        return result(node, FAIL, "; ".join(problems),
                      f"name the interface that carries the route to the other nodes ({', '.join(devices)}) in "
                      f"the inventory's env:, or route them through {', '.join(named.values())}")
    return result(node, PASS, f"every other node is routed through {', '.join(named.values())}")
