"""Host checks: what a node's operating system gives the ranks (torch importable, limits, /dev/shm, disk,
workdir, clock). Pure functions of the probe report (launchers/probe.py)."""
from __future__ import annotations

from typing import Mapping

from nodectl.preflight.checks import check
from nodectl.probe_report import ProbeReport, Space
from nodectl.preflight.verdict import FAIL, PASS, SKIP, WARN, CheckResult, gib, result

SHM_MIN = 1 << 30


DISK_WARN, DISK_FAIL = 20 << 30, 2 << 30


SKEW_WARN, SKEW_FAIL = 1.0, 30.0


NOFILE_FAIL, NOFILE_WARN = 1024, 65536


@check("torch", "host", given=lambda f: (f.report, f.device),
       doc=(("torch",
            "default tier: `import torch` on the node (version, CUDA, NCCL, `cuda.is_available`); `--quick`: the "
            "installed packages (torch, torch/version.py, nvidia-nccl-*, nvidia-cudnn-*)",
            "fail when it does not import (default tier) or is not installed, or CUDA is unavailable on a `device: "
            "cuda` node",
            "-"),))
def check_torch(node: str, report: ProbeReport, device: str) -> CheckResult:
    torch = report.torch
    python = report.python.executable or "python3"
    if torch.error is not None:
        return result(node, FAIL, f"torch does not import for {python}: {torch.error}",
                      f"install it into that interpreter: {python} -m pip install torch (the CUDA build "
                      f"your driver supports), or set python: in hosts.yaml to one that has it")
    if device == "cuda" and torch.imported and not torch.cuda_available:
        return result(node, FAIL, f"torch {torch.version} sees no CUDA device",
                      "install a CUDA build of torch (not +cpu), check the driver with nvidia-smi, or use "
                      "device: cpu for this node")
    return result(node, PASS, f"torch {torch.version} (CUDA {torch.cuda or '-'}, NCCL {torch.nccl or '-'})")


@check("container", "host",
       doc=(("container (nodes with `container:`)",
            "runctl's `container` call: the runtime's `version` and `info` as the SSH user, `image inspect` (a "
            "missing image is pulled first), then the probe run in a throwaway container of the image with the "
            "node's network, GPUs and hard limits",
            "fail: runtime not installed, not usable by the user (its words), image absent and not pullable, probe "
            "not run in the image (an rlimit refusal gets its own hint)",
            "the node's ranks run what the image holds: the torch, cuda, nccl, python and packages rows of that node "
            "(and the cluster's `same ...` rows) are the image's"),))
def check_container(node: str, report: ProbeReport) -> CheckResult | list[CheckResult]:
    """The node's container runtime, where the node's ranks run in an image (nodectl/container.py); no check at
    all for a node without one."""
    facts = report.container
    if facts is None:
        return []
    runtime, image = facts.runtime, facts.image
    if facts.installed is False:
        return result(node, FAIL, f"{runtime} is not installed",
                      f"install {runtime} on the node (NODE_SETUP.md, Containers), or set container.runtime: "
                      f"to the one it has")
    if not facts.usable:
        return result(node, FAIL, f"{runtime} cannot be used by the login user: {_last_line(facts.usable_output)}",
                      "for docker, add the user to the docker group (or run rootless docker); for podman, "
                      "check `podman info` as that user")
    if facts.image_present is False:
        why = _last_line(facts.pull_output) or "not on the node"
        return result(node, FAIL, f"image {image} is not on the node and could not be pulled: {why}",
                      f"{runtime} pull {image} on the node (or load it: {runtime} load -i IMAGE.tar); check the "
                      f"name and the registry login")
    if facts.probe_error:
        error = _last_line(facts.probe_error)
        hint = (f"container.python: must name the image's interpreter; try {runtime} run --rm {image} python3 -c "
                f"'import torch' on the node")
        if "rlimit" in error:
            hint = ("the runtime could not set a resource limit in the container (rlimit type 6 is processes, 7 open "
                    "files, 8 locked memory); give one the node allows in container.options, e.g. "
                    "[--ulimit, 'nproc=32768:32768']")
        return result(node, FAIL, f"the probe did not run in image {image}: {error}", hint)
    pulled = ", pulled now" if facts.pulled else ""
    ident = facts.image_id.split(":")[-1][:12] if facts.image_id else "?"
    return result(node, PASS, f"{runtime} {facts.version or '?'}, image {image} ({ident}{pulled})")


@check("environment", "host",
       doc=(("environment (nodes with `environment:`)",
            "runctl's `env_status`: the venv of the lock's key, its manifest against the files now",
            "pass: built and unchanged (the probe then runs its python); warn: not built yet (launch builds it); "
            "fail: files changed, added or removed since the build, named",
            "drift is impossible only if a changed venv is never used: launch sets it aside and builds again"),))
def check_environment(node: str, report: ProbeReport) -> CheckResult | list[CheckResult]:
    """The node's locked venv (hosts.yaml environment:, nodectl/environment.py); no check for a node without one."""
    facts = report.environment
    if facts is None:
        return []
    key, file = facts.key, facts.file
    if not facts.present:
        return result(node, WARN, f"no venv for {file} yet (key {key}); the ranks would run "
                      f"{report.python.executable or '?'}",
                      "nodectl launch builds it before starting (or reuses it when it is there)")
    if not facts.intact:
        files = [*facts.changed, *facts.added, *facts.removed]
        return result(node, FAIL, f"venv {key} for {file} changed since it was built: "
                      f"{facts.drift} file(s) ({', '.join(files[:3])})",
                      "nodectl launch sets it aside and builds it again from the lock; change the lock, "
                      "not the venv")
    packages = f"{facts.packages} packages" if facts.packages else "from the node's index"
    return result(node, PASS, f"venv {key} for {file} ({packages}, {facts.installer}), "
                              f"unchanged since built")


def _last_line(text) -> str:
    lines = [line.strip() for line in str(text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


@check("memlock", "host", cuda_only=True, section="limits",
       doc=(("memlock",
            "`RLIMIT_MEMLOCK`",
            "fail when not unlimited with InfiniBand present",
            "NCCL registers memory for RDMA (NCCL docs)"),))
def check_memlock(node: str, report: ProbeReport) -> CheckResult:
    soft = report.limits.memlock_soft
    if not report.infiniband and not report.infiniband_error:
        return result(node, SKIP if soft != "unlimited" else PASS,
                      f"memlock {soft} (only matters with InfiniBand)")
    if soft != "unlimited":
        return result(node, FAIL, f"memlock is {soft} bytes with InfiniBand present",
                      "add '* soft memlock unlimited' and '* hard memlock unlimited' to "
                      "/etc/security/limits.conf (LimitMEMLOCK=infinity for services), then log in again")
    return result(node, PASS, "unlimited")


@check("nofile", "host", section="limits",
       doc=(("nofile",
            "`RLIMIT_NOFILE` soft (and hard, shown)",
            "fail under 1024, warn under 65536",
            "sockets to every peer per rank, data-loader descriptor sharing; 1024 is the common default soft limit"),))
def check_nofile(node: str, report: ProbeReport) -> CheckResult:
    """Open files: every rank holds sockets to its peers (NCCL, gloo, the TCP store), data loader workers share
    tensors through descriptors; 1024 is soon spent at scale, a few hundred at once."""
    soft, hard = report.limits.nofile_soft, report.limits.nofile_hard
    if soft is None:
        return result(node, SKIP, "the probe did not read the open-files limit")
    fix = ("add '* soft nofile 1048576' and '* hard nofile 1048576' to /etc/security/limits.conf "
           "(LimitNOFILE=1048576 for services), then log in again")
    if isinstance(soft, int) and soft < NOFILE_FAIL:
        return result(node, FAIL, f"open files limited to {soft} (hard {hard})", fix)
    if isinstance(soft, int) and soft < NOFILE_WARN:
        return result(node, WARN, f"open files limited to {soft} (hard {hard})", fix)
    return result(node, PASS, f"{soft} open files")


@check("shm", "host", section="disk",
       doc=(("shm",
            "`/dev/shm` size",
            "fail under 1 GiB",
            "docker's 64 MB default breaks NCCL's SHM transport and data loaders"),))
def check_shm(node: str, report: ProbeReport) -> CheckResult:
    shm = report.disk.shm_bytes
    if shm is None:
        return result(node, FAIL, "/dev/shm is missing", "mount a tmpfs on /dev/shm")
    if shm < SHM_MIN:
        return result(node, FAIL, f"/dev/shm is {gib(shm)}",
                      "at least 1 GiB: in docker use --shm-size=16g or --ipc=host; else "
                      "mount -o remount,size=16G /dev/shm")
    return result(node, PASS, gib(shm))


@check("disk", "host", section="disk",
       doc=(("disk",
            "free bytes and free inodes of the file system under the workdir (`statvfs`)",
            f"fail under 2 GiB or under {1000:,} inodes (\"inodes exhausted\", naming the mount: a full inode table "
            "refuses new files with ENOSPC while bytes are free), warn under 20 GiB or under 5% of the inodes",
            "checkpoints of a LoRA run; torch.compile and Triton caches write thousands of small files"),))
def check_disk(node: str, report: ProbeReport) -> CheckResult:
    free, where = report.disk.free_bytes, report.disk.workdir or "workdir"
    if free is None:
        return result(node, SKIP, "free space could not be read")
    inodes = inode_verdict("disk", node, report.disk, where)
    if inodes is not None and (inodes.verdict == FAIL or free >= DISK_WARN):
        return inodes
    if free < DISK_FAIL:
        return result(node, FAIL, f"{gib(free)} free in {where}", "free space or move workdir:")
    if free < DISK_WARN:
        return result(node, WARN, f"{gib(free)} free in {where}", "checkpoints may not fit")
    return result(node, PASS, f"{gib(free)} free")


INODES_FAIL, INODES_WARN_SHARE = 1000, 0.05


def inode_verdict(name: str, node: str, facts: Space, where: str) -> CheckResult | None:
    """A file system out of (or short of) inodes, by the probe's statvfs; None when it has enough or does not
    count them (btrfs, some network file systems: 0 total)."""
    free, total, mount = facts.free_inodes, facts.total_inodes, facts.mount or where
    if free is None or total is None or total <= 0:
        return None
    said = f"{free:,} of {total:,} inodes free on {mount}"
    if free < INODES_FAIL:
        return CheckResult(name, node, FAIL, f"inodes exhausted on {mount} (df -i): {said}, while "
                                             f"{gib(facts.free_bytes or 0)} are free: no new file can be made "
                                             f"there", f"remove small files on {mount} (find {mount} -xdev -type f "
                                                       f"| cut -d/ -f1-4 | sort | uniq -c | sort -n shows where they "
                                                       f"are), or move {where} to another file system")
    if free < total * INODES_WARN_SHARE:
        return CheckResult(name, node, WARN, f"few inodes left on {mount} (df -i): {said}",
                           f"remove small files on {mount}; checkpoints and compile caches need new files")
    return None


SCRATCH_WARN = 4 << 30
NPROC_FAIL, NPROC_WARN = 4096, 16384   # threads count: each rank runs dozens (NCCL, gloo, loaders, compile pool)
SCRATCH_USE = {"tmp": "torch.compile, Triton and data loaders write there",
               "cache": "Hugging Face downloads and Triton kernels are cached there"}


@check("tmp, cache", "host",
       doc=(("tmp, cache",
            "a 1 MiB test write (flushed) and free space in the temp folder (`$TMPDIR`, else `/tmp`: what gcc, "
            "ptxas, mktemp and Triton use; not Python's `tempfile.gettempdir()`, which passes over a full /tmp to "
            "/var/tmp) and the cache folder (`HF_HOME`, `XDG_CACHE_HOME`, else `~/.cache`), with the node's "
            "inventory `env:` applied as the ranks get it",
            "fail when not writable (a full disk included) or when `$TMPDIR` names a folder that does not exist "
            "(preflight makes none), warn under 4 GiB free",
            "torch.compile and Triton write to the temp folder, Hugging Face and Triton cache under ~/.cache: a "
            "read-only or full one fails a rank at its first compiled graph or download, long after preflight"),))
def check_scratch(node: str, report: ProbeReport) -> list[CheckResult]:
    """The temp folder and the cache folder a rank gets: writable, with room."""
    out = []
    for key in ("tmp", "cache"):
        found = getattr(report.disk.scratch, key)
        if found is None or found.writable is None:
            out.append(CheckResult(key, node, SKIP, "the probe did not read it"))
            continue
        where = found.path or key
        inodes = inode_verdict(key, node, found, where)
        if inodes is not None and inodes.verdict == FAIL:
            out.append(inodes)
        elif found.missing and key == "tmp":
            out.append(CheckResult(key, node, FAIL, f"{where} does not exist (a scratch mount that is not there?): "
                                   f"{SCRATCH_USE[key]}, and mktemp and gcc fail in a missing one",
                                   "mount or make it on the node, or point TMPDIR elsewhere in the inventory's env: "
                                   "(preflight makes nothing there)"))
        elif not found.writable:
            out.append(CheckResult(key, node, FAIL, f"{where} cannot be written ({found.write_error}): "
                                   f"{SCRATCH_USE[key]}",
                                   "make it writable for the login user, or point the ranks elsewhere in the "
                                   f"inventory's env: ({'TMPDIR' if key == 'tmp' else 'HF_HOME, XDG_CACHE_HOME'})"))
        elif found.free_bytes is not None and found.free_bytes < SCRATCH_WARN:
            out.append(CheckResult(key, node, WARN, f"{gib(found.free_bytes)} free in {where}: {SCRATCH_USE[key]}",
                                   f"free space there or set {'TMPDIR' if key == 'tmp' else 'HF_HOME'} in env: to a "
                                   f"larger disk"))
        elif found.missing:
            out.append(CheckResult(key, node, PASS, f"{where} does not exist yet; {found.exists_from} above it is "
                                   "writable (made at first use)"))
        else:
            out.append(CheckResult(key, node, PASS, f"{where} writable"))
    return out


RANK_MEMORY_FLOOR = 2 << 30   # below this per rank, loading torch and a model's first shards is already killed


@check("cgroup limits", "host", given=lambda f: (f.report, f.expect.gpus or f.gpus or 1), section="cgroup",
       doc=(("cgroup limits",
            "the cgroup the login runs in, which the ranks inherit (`/proc/self/cgroup`): memory (`memory.max`, v1 "
            "`memory.limit_in_bytes`), CPU quota (`cpu.max`, v1 `cpu.cfs_quota_us`/`cfs_period_us`), the tightest on "
            "the way to the root, with its file",
            "fail when memory is under 2 GiB per rank; warn when memory is below the machine's or the CPU quota "
            "below the rank count; skip when the probe reported none",
            "/proc/meminfo and the CPU count show the machine: a 1 GiB memory cgroup let preflight pass, then the "
            "model load was OOM-killed with no message"),))
def check_cgroup(node: str, report: ProbeReport, ranks: int) -> CheckResult:
    """The memory and CPU the ranks may use under the login's cgroup, which they inherit: a model load past the
    memory limit is OOM-killed with no message, and a CPU quota below the rank count slows every step, while
    /proc/meminfo and the CPU count show the whole machine."""
    memory, cpu, machine = report.cgroup.memory, report.cgroup.cpu, report.memory.total_bytes
    fix = ("raise or lift it for the user that logs in (systemd: MemoryMax=/CPUQuota= of its slice, e.g. "
           "systemctl set-property user-UID.slice MemoryMax=infinity; a container: --memory/--cpus), or use a node "
           "without it")
    limit = memory.limit
    if isinstance(limit, int) and limit < RANK_MEMORY_FLOOR * ranks:
        return result(node, FAIL,
                      f"the ranks may use {gib(limit)} of memory ({memory.file}), "
                      f"{ranks} rank(s) here: loading torch and a model is killed by the OOM killer, silently",
                      fix)
    problems = []
    if isinstance(limit, int) and machine is not None and limit < machine:
        problems.append(f"memory limited to {gib(limit)} of the machine's {gib(machine)} ({memory.file})")
    quota = cpu.limit
    if quota is not None and quota < ranks:
        problems.append(f"CPU quota of {quota:g} CPU(s) for {ranks} rank(s) ({cpu.file})")
    if problems:
        return result(node, WARN, "; ".join(problems), fix)
    shown = [f"memory {gib(limit)}" if isinstance(limit, int) else None,
             f"{quota:g} CPUs" if quota is not None else None]
    return result(node, PASS, ", ".join(s for s in shown if s) or "none below the machine's")


@check("processes", "host",
       doc=(("processes",
            "`RLIMIT_NPROC` soft (`ulimit -u`, which counts the user's threads) and the session's pids cgroup "
            "(`pids.max`)",
            "fail under 4096, warn under 16384, naming the lower",
            "every rank runs dozens of threads (NCCL, gloo, data loaders, torch.compile's worker pool); a "
            "container's `--pids-limit` or systemd's `TasksMax=` is met as \"can't start new thread\""),))
def check_processes(node: str, report: ProbeReport) -> CheckResult:
    """Processes and threads a session may run (RLIMIT_NPROC counts the user's threads; a pids cgroup counts the
    session's): a rank starts dozens of threads, torch.compile a worker pool, each data loader worker more."""
    soft, pids = report.limits.nproc_soft, report.limits.pids_max
    if soft is None and pids is None:
        return result(node, SKIP, "the probe did not read the process limits")
    limits = {name: v for name, v in (("ulimit -u", soft), ("pids cgroup", pids))
              if isinstance(v, int)}
    if not limits:
        return result(node, PASS, "no limit on processes and threads")
    name, lowest = min(limits.items(), key=lambda item: item[1])
    fix = ("raise it: '* soft nproc 65536' in /etc/security/limits.conf for ulimit -u; TasksMax= (systemd) or the "
           "container's --pids-limit for the pids cgroup")
    if lowest < NPROC_FAIL:
        return result(node, FAIL, f"{name} allows {lowest} processes and threads", fix)
    if lowest < NPROC_WARN:
        return result(node, WARN, f"{name} allows {lowest} processes and threads", fix)
    return result(node, PASS, f"{lowest} processes and threads ({name})")


@check("workdir", "host",
       doc=(("workdir",
            "a test write in the workdir (in the folder above it where it does not exist yet: preflight makes "
            "nothing, the launch makes it)",
            "fail with the path and the error",
            "-"),))
def check_workdir(node: str, report: ProbeReport) -> CheckResult:
    """The workdir must take the run folders: created and written by the login user."""
    reason, disk = report.unreadable("disk"), report.disk
    if reason or disk.writable is None:
        return result(node, SKIP, reason or "writability not probed")
    where = disk.workdir or "workdir"
    if not disk.writable:
        return result(node, FAIL, f"{where} cannot be written ({disk.write_error})",
                      "set workdir: in hosts.yaml to a folder the login user owns (e.g. ~/nodectl or a local "
                      "scratch disk), or fix its owner and mode")
    unsafe = disk.unsafe
    if unsafe is not None:
        return result(node, FAIL, f"{unsafe.path} is {unsafe.why}: runs there could be "
                      f"steered by another user", UNSAFE_FIX)
    if disk.missing:
        return result(node, PASS, f"{where} does not exist yet; the launch makes it ({disk.exists_from} writable)")
    return result(node, PASS, f"{where} writable")


UNSAFE_FIX = ("nodectl keeps its files only in folders the login user owns (mode 0700, no links), under a workdir "
              "that is that user's or root's (sticky where others may write): remove what another user made there, "
              "or set workdir: in hosts.yaml to a folder of your own")


@check("clock", "host",
       doc=(("clock",
            "node time at the probe's midpoint vs the controller",
            "warn over 1 s, fail over 30 s (after half the round trip)",
            "logs and heartbeats are compared by time"),))
def check_clock(node: str, report: ProbeReport) -> CheckResult:
    skew = report.clock.skew_s
    if skew is None:
        return result(node, SKIP, "no clock reading")
    slack = (report.clock.round_trip_s or 0) / 2
    effective = max(0.0, abs(skew) - slack)
    hint = "run chrony or systemd-timesyncd on every node; logs and heartbeats are compared by time"
    if effective > SKEW_FAIL:
        return result(node, FAIL, f"{skew:+.1f}s from the controller", hint)
    if effective > SKEW_WARN:
        return result(node, WARN, f"{skew:+.1f}s from the controller", hint)
    return result(node, PASS, f"{skew:+.2f}s")


@check("overcommit", "host", given=lambda f: (f.report, f.device), section="memory",
       doc=(("overcommit",
            "`vm.overcommit_memory` (`/proc/sys/vm`), with the commit limit and what is committed (`/proc/meminfo`)",
            "fail at 2 (strict) on a `device: cuda` node, warn on a CPU node",
            "CUDA and PyTorch reserve large virtual ranges (the CUDA context, the caching allocator, pinned "
            "memory): under strict accounting they fail with ENOMEM at init or first allocation, whatever is free"),))
def check_overcommit(node: str, report: ProbeReport, device: str) -> CheckResult:
    mode = report.memory.overcommit_memory
    if mode is None:
        return result(node, SKIP, "vm.overcommit_memory could not be read")
    if mode != 2:
        return result(node, PASS, f"vm.overcommit_memory = {mode}")
    limit, committed = report.memory.commit_limit_bytes, report.memory.committed_bytes
    accounts = f" (commit limit {gib(limit)}, {gib(committed)} committed)" if limit and committed is not None else ""
    return result(node, FAIL if device == "cuda" else WARN,
                  f"vm.overcommit_memory = 2, strict accounting{accounts}: CUDA and PyTorch reserve large "
                  f"virtual ranges and fail with ENOMEM at init or their first allocation",
                  f"on {node}: sysctl -w vm.overcommit_memory=0 (heuristic, the default), and the same in "
                  f"/etc/sysctl.d/ to keep it after a reboot")


LOOPBACK_PREFIXES = ("127.", "::1", "0:0:0:0:0:0:0:1")


@check("hostname", "host", given=lambda f: (f.report, f.addr, f.device, f.expect.nodes, f.env), section="os",
       doc=(("hostname",
            "the node's host name as its resolver gives it (`getaddrinfo`, `/etc/hosts` first) and the /etc/hosts "
            "line that names it; `GLOO_SOCKET_IFNAME` in the environment its ranks get",
            "over several nodes without `GLOO_SOCKET_IFNAME`: fail on a CPU node (warn on a GPU node, where only "
            "gloo groups use it) when the name's first address is a loopback one (Debian's `127.0.1.1 <hostname>` "
            "kept in an image) or the name does not resolve (gloo then binds 127.0.0.1), naming the line and "
            "the fix; else warn when it resolves to a loopback address while the other nodes reach the node at "
            "another one",
            "gloo binds the address its host name resolves to and hands it to the other ranks: they connect to "
            "their own loopback and the collective fails with `Connection refused, remote=[127.0.1.1]`, blamed on "
            "the rank that connected"),))
def check_hostname(node: str, report: ProbeReport, addr: str, device: str = "cpu", nodes: int = 1,
                   env: Mapping[str, str] | None = None) -> CheckResult:
    name, found = report.os.hostname, report.os.hostname_resolves
    if not name or found is None:
        return result(node, SKIP, "the host name was not resolved")
    single_host = not addr or addr.startswith(LOOPBACK_PREFIXES) or addr == "localhost"
    pinned = (env or {}).get("GLOO_SOCKET_IFNAME") or (report.env or {}).get("GLOO_SOCKET_IFNAME")
    gloo_breaks = nodes > 1 and not single_host and not pinned
    verdict = FAIL if device != "cuda" else WARN
    who = "its ranks (gloo, the CPU backend)" if device != "cuda" else "any gloo group of its ranks"
    pin = f"or set GLOO_SOCKET_IFNAME to the interface that carries {addr} in the inventory's env:"
    if not isinstance(found, tuple):   # resolves to nothing ({"error"})
        if gloo_breaks:
            return result(node, verdict,
                          f"{name} does not resolve on {node} ({found.get('error')}): {who} bind 127.0.0.1 and "
                          f"hand it to the other nodes, which cannot connect to it",
                          f"on {node}, map {name} to {addr} in /etc/hosts ({addr} {name}), {pin}")
        return result(node, PASS, f"{name} does not resolve on the node ({found.get('error')})")
    loopback = [a for a in found if str(a).startswith(LOOPBACK_PREFIXES)]
    if not loopback or single_host:
        return result(node, PASS, f"{name} resolves to {', '.join(map(str, found)) or 'nothing'}")
    line = report.os.hosts_line
    where = f" (/etc/hosts line {line.line}: {line.text!r})" if line is not None else ""
    fix = f"on {node}, map {name} to {addr} in /etc/hosts{' instead of that line' if line is not None else ''}"
    if gloo_breaks and str(found[0]).startswith(LOOPBACK_PREFIXES):
        return result(node, verdict,
                      f"{name} resolves to {found[0]}{where}: {who} bind that address and hand it to the other "
                      f"nodes, which reach {node} at {addr} and cannot connect to it", f"{fix}, {pin}")
    return result(node, WARN,
                  f"{name} resolves to {', '.join(loopback)}{where}, while the other nodes reach {node} at "
                  f"{addr}: a launcher that finds its own address by host name hands them one they cannot "
                  f"reach", f"{fix} (or remove the loopback line)")
