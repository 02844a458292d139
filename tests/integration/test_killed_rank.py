"""A rank killed with SIGKILL together with its wrapper (the OOM killer takes the biggest, a `kill -9` of the
process group takes all) leaves no exit code; its node still answers. `status` says
it was killed, not that it was lost (which is what a node that restarted under its run is)."""
from __future__ import annotations

import json
import os
import signal
import sys

import psutil
import pytest

from support.cli import run_nodectl
from support.launch import kill_leftovers, latest_run_id, wait_for

pytestmark = pytest.mark.slow

SCRIPT = "import os, time\nprint('rank', os.environ['RANK'], 'pid', os.getpid(), flush=True)\ntime.sleep(60)\n"


def test_a_rank_killed_with_sigkill_is_killed_not_lost(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, gpus: 2, "
                     f"python: {sys.executable}, workdir: {tmp_path / 'work'}}}\n")
    env = dict(os.environ, NODECTL_INVENTORY=str(hosts), COLUMNS="200")
    started = run_nodectl(["launch", "--skip-preflight", "--detach", "--", "train.py"], env=env, cwd=tmp_path)
    assert started.exit_code == 0, started.output
    run_id = latest_run_id(tmp_path)
    try:
        ranks = wait_for(lambda: (lambda rs: rs if any(r["rank"] == 1 for r in rs) else None)(
            [r for r in run_nodectl(["--json", "status"], env=env, cwd=tmp_path).json()["ranks"] if r.get("pid")]),
            timeout=60)
        victim = next(r for r in ranks if r["rank"] == 1)
        wrapper = psutil.Process(victim["pid"]).parent()   # rankexec, which records a rank's exit: killed first
        assert "rankexec" in " ".join(wrapper.cmdline())
        os.kill(wrapper.pid, signal.SIGKILL)
        try:   # the rank dies with its wrapper (lib/rankexec.py: PR_SET_PDEATHSIG) and may be gone already
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        status = wait_for(lambda: (lambda s: s if any(r["rank"] == 1 and r["state"] == "killed" for r in s["ranks"])
                                   else None)(run_nodectl(["--json", "status"], env=env, cwd=tmp_path).json()),
                          timeout=60)
        assert not any(r["state"] == "lost" for r in status["ranks"]), json.dumps(status["ranks"])
        shown = run_nodectl(["status"], env=env, cwd=tmp_path)
        assert "killed" in shown.stdout and "SIGKILL or the kernel's OOM killer" in shown.stdout, shown.stdout
    finally:
        run_nodectl(["stop", "--run", run_id], env=env, cwd=tmp_path)
        kill_leftovers(run_id)


# The audit's escape: a process out of every cgroup nodectl could have put it in, in a session of its own after a
# double fork, with no environment, deaf to SIGTERM; its pid written to `marker` once it is all that.
ESCAPE_FUNCTION = r"""
import os, signal, sys, time

def escape(marker):
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork():
            os._exit(0)
        with open("/proc/self/mounts") as mounts:
            for fields in (line.split() for line in mounts):
                if fields[2] in ("cgroup", "cgroup2"):
                    try:
                        with open(os.path.join(fields[1], "cgroup.procs"), "w") as procs:
                            procs.write(str(os.getpid()))
                    except OSError:
                        pass
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(marker + ".tmp", "w") as out:
            out.write(str(os.getpid()))
        os.rename(marker + ".tmp", marker)
        os.execve("/bin/sleep", ["sleep", "304"], {})
    os.waitpid(child, 0)
"""
ESCAPE = ESCAPE_FUNCTION + r"""
if os.environ["RANK"] == "0":
    escape(sys.argv[1])
time.sleep(300)
"""


def test_a_rank_that_leaves_its_cgroup_session_and_environment_is_still_stopped(tmp_path):
    """A rank running as root forks a process that moves itself to the root of every cgroup hierarchy, starts its
    own session, double-forks, ignores SIGTERM and clears its environment (the audit's escape). `stop` ends it
    too and says nothing is left: once proven the run's (a descendant of launch.sh, the run's subreaper), it is
    held by a pidfd. Before, a grace shorter than launch.sh's own clean-up (which SIGKILLs what is left below it 2 s
    after SIGTERM) had stop SIGKILL launch.sh first, the orphan went to init, and stop said 0 left."""
    (tmp_path / "train.py").write_text(ESCAPE)
    marker = tmp_path / "escaped.pid"
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, gpus: 1, "
                     f"python: {sys.executable}, workdir: {tmp_path / 'work'}}}\n")
    env = dict(os.environ, NODECTL_INVENTORY=str(hosts), COLUMNS="200")
    started = run_nodectl(["launch", "--skip-preflight", "--detach", "--", "train.py", str(marker)], env=env,
                          cwd=tmp_path)
    assert started.exit_code == 0, started.output
    run_id = latest_run_id(tmp_path)
    escaped = None
    try:
        escaped = int(wait_for(lambda: marker.exists() and marker.read_text(), timeout=60))
        proc = psutil.Process(escaped)
        wait_for(lambda: proc.name() == "sleep" or None, timeout=10)
        assert not proc.environ(), "the escape kept its environment"
        stopped = run_nodectl(["--json", "stop", "--run", run_id, "--grace", "1"], env=env, cwd=tmp_path)
        assert stopped.exit_code == 0, stopped.output
        gone = wait_for(lambda: (not psutil.pid_exists(escaped) or psutil.Process(escaped).status() == "zombie")
                        or None, timeout=10)
        assert gone
        assert "0 left" in stopped.output, stopped.output
    finally:
        if escaped and psutil.pid_exists(escaped):
            os.kill(escaped, signal.SIGKILL)
        run_nodectl(["stop", "--run", run_id], env=env, cwd=tmp_path)
        kill_leftovers(run_id)


ESCAPE_TWICE = ESCAPE_FUNCTION + r"""
folder = sys.argv[1]
escape(os.path.join(folder, "first.pid"))
while not os.path.exists(os.path.join(folder, "go")):
    time.sleep(0.1)
escape(os.path.join(folder, "second.pid"))
time.sleep(300)
"""


def test_a_process_that_escaped_before_launch_sh_died_is_stopped_or_named(tmp_path):
    """The audit's escape (out of the cgroup, its own session, a double fork, no environment), then launch.sh
    itself dies (SIGKILL): nothing below it or in its cgroup proves the escape the run's any more. One that a
    poll (`status`) saw while it was still proven is stopped all the same (its pid and start time were kept);
    one that escaped after the last poll is not signalled but named by `stop`, with how to look at it. Before,
    both survived and stop said nothing of them."""
    (tmp_path / "train.py").write_text(ESCAPE_TWICE)
    folder = tmp_path / "marks"
    folder.mkdir()
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, gpus: 1, "
                     f"python: {sys.executable}, workdir: {tmp_path / 'work'}}}\n")
    env = dict(os.environ, NODECTL_INVENTORY=str(hosts), COLUMNS="200")
    started = run_nodectl(["launch", "--skip-preflight", "--detach", "--", "train.py", str(folder)], env=env,
                          cwd=tmp_path)
    assert started.exit_code == 0, started.output
    run_id = latest_run_id(tmp_path)
    escaped = []
    try:
        escaped.append(int(wait_for(lambda: (folder / "first.pid").exists() and (folder / "first.pid").read_text(),
                                    timeout=60)))
        assert run_nodectl(["status", "--run", run_id], env=env, cwd=tmp_path).exit_code == 0   # one poll
        (folder / "go").write_text("")
        escaped.append(int(wait_for(lambda: (folder / "second.pid").exists() and
                                    (folder / "second.pid").read_text(), timeout=60)))
        first, second = (psutil.Process(pid) for pid in escaped)
        wait_for(lambda: first.name() == "sleep" and second.name() == "sleep" or None, timeout=10)
        launcher = int((tmp_path / "work" / "runs" / run_id / "state" / "pgid").read_text())
        os.kill(launcher, signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(launcher) or psutil.Process(launcher).status() == "zombie" or None,
                 timeout=10)
        stopped = run_nodectl(["--json", "stop", "--run", run_id, "--grace", "1"], env=env, cwd=tmp_path)
        assert stopped.exit_code == 0, stopped.output
        assert wait_for(lambda: not first.is_running() or first.status() == "zombie" or None, timeout=10)
        assert second.is_running(), "a process nothing proved the run's was signalled"
        answer = stopped.json()["nodes"]["n0"]
        assert answer["left"] == 0, answer
        if second.ppid() == 1:   # left to init, as on a node (a subreaper above would keep it)
            assert second.pid in [p["pid"] for p in answer["unproven"]], answer
            assert f"{second.pid} (sleep, since" in stopped.stderr and "not proven the run's" in stopped.stderr
    finally:
        for pid in escaped:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
        run_nodectl(["stop", "--run", run_id], env=env, cwd=tmp_path)
        kill_leftovers(run_id)
