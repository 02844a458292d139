"""Where the suite's CPU goes, test by test: a pytest plugin, off unless named.

    cd tests && ../.venv/bin/python -m pytest -q -n 0 -p support.cpu_profile -o addopts="-ra" [FILES]

Each test's CPU seconds are the whole machine's (user, nice, system, irq and softirq of /proc/stat) between its
start and its end, so they include what it started elsewhere: the simulated nodes' sshd sessions, torchrun and
the ranks, containers. That is only right when tests run one at a time (`-n 0`) on a machine doing nothing else.
A module's or session's fixture is counted in the first test that uses it. At the end it prints each file's CPU
and wall seconds, the largest first, and NODECTL_CPU_PROFILE=FILE also keeps one JSON line per test there.
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict

_started: dict[str, tuple[float, float]] = {}
_done: list[dict] = []


def machine_cpu_seconds() -> float:
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def pytest_runtest_logstart(nodeid, location) -> None:
    _started[nodeid] = (machine_cpu_seconds(), time.monotonic())


def pytest_runtest_logfinish(nodeid, location) -> None:
    began = _started.pop(nodeid, None)
    if began is None:
        return
    row = {"test": nodeid, "cpu_s": round(machine_cpu_seconds() - began[0], 2),
           "wall_s": round(time.monotonic() - began[1], 2)}
    _done.append(row)
    if os.environ.get("NODECTL_CPU_PROFILE"):
        with open(os.environ["NODECTL_CPU_PROFILE"], "a") as out:
            out.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter) -> None:
    if not _done:
        return
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for row in _done:
        totals = by_file[row["test"].split("::", 1)[0]]
        totals[0] += row["cpu_s"]
        totals[1] += row["wall_s"]
        totals[2] += 1
    write = terminalreporter.write_line
    write(f"CPU seconds by file (machine-wide, {len(_done)} tests, "
          f"{sum(r['cpu_s'] for r in _done):.1f} CPU s in all):")
    for name, (cpu, wall, count) in sorted(by_file.items(), key=lambda item: -item[1][0]):
        write(f"  {cpu:8.1f} CPU s {wall:8.1f} s wall {count:4d} test(s)  {name}")
