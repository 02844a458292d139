"""What the pace verdict reads on a node: each rank's latest collectives (its pace file, refreshed here from the
rank's flight recorder through torch's worker server when its last copy is older than the rank's pace interval:
lib/flightpace.py), and what can slow a rank down there: its CPU time and run-queue wait, its cgroup's CPU throttling, the node's load and steal, and on
request the GPU's other processes, clock event reasons and PCIe link."""
from __future__ import annotations

import json
import os
import pwd
import subprocess
import time

import flightpace
import runlayout as layout
from nodeio import LinkRefused, walk
from runctl.common import read_json, write_file
from runctl.processes import cgroups_of

NEW_ENTRIES_MAX = 2000   # entries one answer carries per rank (the pace file holds fewer)


def rank_pace(run_dir: str, rank: int, pid: int | None, since: int) -> dict:
    """The rank's collectives reached after `since` (ns since the epoch) and its scheduler counters."""
    path = os.path.join(run_dir, layout.rank_pace(rank))
    recorded = read_json(path)
    if isinstance(recorded, dict) and recorded.get("socket"):
        recorded = _served(run_dir, rank, path, recorded)
    entries = []
    if isinstance(recorded, dict) and isinstance(recorded.get("entries"), list):
        entries = [e for e in recorded["entries"]
                   if isinstance(e, list) and 4 <= len(e) <= 6 and isinstance(e[1], int) and isinstance(e[2], int)
                   and e[2] > since]
    entries = entries[-NEW_ENTRIES_MAX:]
    answer = {"groups": [str(e[0]) for e in entries], "seqs": [int(e[1]) for e in entries],
              "reached": [e[2] for e in entries],
              "durations": [float(e[3]) if isinstance(e[3], (int, float)) else None for e in entries],
              "moved": [e[4] if len(e) > 4 and isinstance(e[4], int) and e[4] >= 0 else None for e in entries],
              "kinds": [str(e[5])[:16] if len(e) > 5 else None for e in entries]}
    if pid:
        answer.update(_sched(pid))
    return answer


FETCH_TIMEOUT = 3.0   # seconds a rank's worker server has to answer


def _served(run_dir: str, rank: int, path: str, recorded: dict) -> dict:
    """The pace record of a rank that serves its recorder, with rows at most its pace interval old: copied now
    from its worker server when older, and kept for the next poll. A rank that is gone keeps its last rows."""
    every = recorded.get("every")
    every = float(every) if isinstance(every, (int, float)) and not isinstance(every, bool) and every > 0 else 5.0
    copied = recorded.get("copied")
    if isinstance(copied, (int, float)) and 0 <= time.time() - copied < every:
        return recorded
    handlers = [h for h in recorded.get("handlers") or () if h in flightpace.HANDLERS]
    began = time.perf_counter()
    try:
        dir_fd = walk(os.path.dirname(os.path.join(run_dir, layout.rank_socket(rank))))
    except (OSError, ValueError):
        return recorded
    entries: list = []
    try:
        for handler in handlers:   # NCCL's recorder first; a gloo run's is the other
            entries = flightpace.fetch(dir_fd, os.path.basename(layout.rank_socket(rank)), handler, FETCH_TIMEOUT)
            if entries:
                break
    except (OSError, ValueError):   # the rank is gone (or going): its last rows stand
        return recorded
    finally:
        os.close(dir_fd)
    rows = flightpace.pace_rows(entries, bool(recorded.get("timed")))
    fresh = dict(recorded, entries=rows, copied=time.time(), copy_ms=round((time.perf_counter() - began) * 1e3, 1))
    try:
        write_file(path, json.dumps(fresh))
    except (OSError, LinkRefused):
        pass
    return fresh


def _sched(pid: int) -> dict:
    """Seconds of CPU the process used (all its threads), seconds its main thread (the one that runs the training
    loop) waited on a run queue for a CPU, and its cgroup's CPU throttling (seconds; None without a CPU limit),
    all counters since it started."""
    cpu = wait = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat", encoding="ascii") as handle:
                    ran, waited, _ = handle.read().split()
                cpu += int(ran)
                if task == str(pid):
                    wait = int(waited)
            except (OSError, ValueError):
                continue
    except OSError:
        return {}
    return {"cpu_s": cpu / 1e9, "runqueue_s": wait / 1e9, "throttled_s": _throttled(pid)}


def _throttled(pid: int) -> float | None:
    """Seconds the process's cgroup was held back by its CPU quota (cgroup v2 throttled_usec, v1 throttled_time)."""
    for keys, path in cgroups_of(pid) or ():
        if keys == "":
            candidates = [f"/sys/fs/cgroup{path}/cpu.stat", f"/sys/fs/cgroup/unified{path}/cpu.stat"]
        elif "cpu" in keys.split(","):
            candidates = [f"/sys/fs/cgroup/{keys}{path}/cpu.stat", f"/sys/fs/cgroup/cpu{path}/cpu.stat",
                          f"/sys/fs/cgroup/cpu,cpuacct{path}/cpu.stat"]
        else:
            continue
        for candidate in candidates:
            stats = _keyed(candidate)
            if "throttled_usec" in stats:
                return stats["throttled_usec"] / 1e6
            if "throttled_time" in stats:
                return stats["throttled_time"] / 1e9
    return None


def _keyed(path: str) -> dict:
    try:
        with open(path, encoding="ascii") as handle:
            return {k: int(v) for k, v in (line.split() for line in handle if len(line.split()) == 2)}
    except (OSError, ValueError):
        return {}


def node_cpu() -> dict:
    """The node's 1-minute load, its CPUs, and counters: the seconds its CPUs were stolen by the hypervisor, the
    seconds some of its tasks stalled on memory and on I/O (pressure stall information, Linux 4.20+), the pages
    swapped in and out."""
    answer: dict = {"cpus": os.cpu_count() or 1}
    try:
        with open("/proc/loadavg", encoding="ascii") as handle:
            answer["load1"] = float(handle.read().split()[0])
        with open("/proc/stat", encoding="ascii") as handle:
            fields = handle.readline().split()
        answer["steal_s"] = int(fields[8]) / (os.sysconf("SC_CLK_TCK") or 100) if len(fields) > 8 else 0.0
    except (OSError, ValueError, IndexError):
        pass
    for kind in ("memory", "io"):
        try:
            with open(f"/proc/pressure/{kind}", encoding="ascii") as handle:
                some = next(line for line in handle if line.startswith("some "))
            answer[f"{'mem' if kind == 'memory' else kind}_some_s"] = int(some.rsplit("total=", 1)[1]) / 1e6
        except (OSError, StopIteration, ValueError, IndexError):
            pass   # a kernel without PSI (or with psi=0): that cause is not seen
    hidden = _hidden_processes()
    if hidden:
        answer["hidden"] = hidden
    try:
        with open("/proc/vmstat", encoding="ascii") as handle:
            counts = dict(line.split() for line in handle if line.startswith(("pswpin ", "pswpout ")))
        answer["swap_pages"] = int(counts.get("pswpin", 0)) + int(counts.get("pswpout", 0))
    except (OSError, ValueError):
        pass
    return answer


_CPU_SEEN: dict = {}   # pid -> (monotonic time, CPU seconds) at this process's last look (a watch stream's)
OTHERS_SHOWN, OTHERS_SHARE = 3, 0.2   # the busiest others told, each using at least this share of a CPU
FIRST_LOOK_S = 0.3    # a one-shot poll has no earlier look: it takes two this far apart


def _hidden_processes() -> str | None:
    """"hidepid=2" where /proc hides other users' processes from this login (not root): the CPU takers
    busiest_others looks for cannot be seen then. None where every process is visible."""
    if os.getuid() == 0:
        return None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) > 4 and fields[4] == "/proc":
                    options = ",".join(fields[5:])
                    found = [o for o in options.replace(" ", ",").split(",") if o.startswith("hidepid=")]
                    if found and found[-1] not in ("hidepid=0", "hidepid=off"):
                        return found[-1]
    except OSError:
        return None
    return None


def first_look(pids: dict) -> dict:
    """A one-shot poll (no earlier look in this process): each rank's scheduler counters and every process's CPU
    time now, then FIRST_LOOK_S of waiting, so its rates have two ends (a detached run's single `status` named no
    cause for a rank its CPU quota held back). {rank: counters, with `ago`}; {} where this process looked before
    (a watch stream)."""
    if _CPU_SEEN:
        return {}
    started = time.monotonic()
    counters = {rank: _sched(pid) for rank, pid in pids.items() if pid}
    _CPU_SEEN.update(_cpu_times())
    time.sleep(FIRST_LOOK_S)
    ago = time.monotonic() - started
    return {rank: {**c, "ago": round(ago, 3)} for rank, c in counters.items() if c}


def busiest_others(markers: tuple) -> list:
    """The node's busiest processes that are not the run's, each with its share of a CPU since this process last
    looked (a watch stream looks at each pace sample; a one-shot poll looked first: first_look): what takes the
    cores a rank waits for. Each is {pid, user, name, share}."""
    from runctl.processes import belongs

    if not _CPU_SEEN:
        first_look({})
    before, now = dict(_CPU_SEEN), _cpu_times()
    _CPU_SEEN.clear()
    _CPU_SEEN.update(now)
    rates = []
    for pid, (at, cpu, name) in now.items():
        earlier = before.get(pid)
        if earlier is not None and at > earlier[0] and earlier[2] == name:
            rates.append(((cpu - earlier[1]) / (at - earlier[0]), pid, name))
    out = []
    for share, pid, name in sorted(rates, reverse=True):
        if share < OTHERS_SHARE or len(out) == OTHERS_SHOWN:
            break
        if pid == os.getpid() or belongs(pid, markers):
            continue
        out.append({"pid": pid, "user": _user_of(pid), "name": name, "share": round(share, 2)})
    return out


def _cpu_times() -> dict:
    """{pid: (monotonic time, user + system CPU seconds, command name)} of every process here."""
    hz = os.sysconf("SC_CLK_TCK") or 100
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="utf-8", errors="replace") as handle:
                text = handle.read()
            head, _, tail = text.rpartition(")")
            fields = tail.split()
            out[int(entry.name)] = (time.monotonic(), (int(fields[11]) + int(fields[12])) / hz,
                                    head.partition("(")[2][:32])
        except (OSError, ValueError, IndexError):
            continue
    return out


GPU_DETAIL = ("index", "uuid", "clocks_event_reasons.active", "pcie.link.gen.gpucurrent", "pcie.link.gen.max",
              "pcie.link.width.current", "pcie.link.width.max")


def gpu_detail(run_pids: set) -> dict:
    """Per GPU index: the processes on it that are not this run's (pid, user, name), its clock event reasons
    (a bit mask, NVML's), and its PCIe link now and at best. {} without nvidia-smi."""
    try:
        gpus = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_DETAIL)}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    by_uuid, detail = {}, {}
    for line in gpus.stdout.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(GPU_DETAIL) or not cells[0].isdigit():
            continue
        index, uuid = int(cells[0]), cells[1]
        by_uuid[uuid] = index
        detail[str(index)] = {"reasons": _int(cells[2]), "pcie_gen": _int(cells[3]), "pcie_gen_max": _int(cells[4]),
                              "pcie_width": _int(cells[5]), "pcie_width_max": _int(cells[6]), "others": []}
    for line in apps.stdout.splitlines():
        cells = [c.strip() for c in line.split(",", 2)]
        if len(cells) < 2 or cells[0] not in by_uuid or not cells[1].isdigit():
            continue
        pid = int(cells[1])
        if pid in run_pids:
            continue
        detail[str(by_uuid[cells[0]])]["others"].append({"pid": pid, "user": _user_of(pid),
                                                          "name": cells[2] if len(cells) > 2 else ""})
    return detail


def _int(text: str):
    try:
        return int(text, 16) if text.startswith("0x") else int(text)
    except ValueError:
        return None


def _user_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            uid = next(int(line.split()[1]) for line in handle if line.startswith("Uid:"))
        return pwd.getpwuid(uid).pw_name
    except (OSError, StopIteration, ValueError, KeyError):
        return "?"
