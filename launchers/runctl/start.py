"""Starting launch.sh detached, in a session and a cgroup of its own."""
from __future__ import annotations

import json
import os
import subprocess
import time

import runlayout as layout
from runctl.common import boot_id, lstat_nofollow, open_nofollow, read_json, write_file
from runctl.processes import become_subreaper, in_group, join_group, keep_start, new_run_group, remove_group


def cmd_start(args: list, request: dict) -> dict:
    """Start launch.sh detached in its own session; it survives the SSH connection that started it."""
    run_dir = os.path.expanduser(args[0])
    node = read_json(os.path.join(run_dir, layout.NODE_JSON))
    if lstat_nofollow(os.path.join(run_dir, layout.PGID)) is not None:
        return {"error": f"{run_dir} was already started"}
    env = dict(os.environ, NODECTL_RUN_ID=node["run_id"], NODECTL_NODE_RANK=str(node["node_rank"]))
    group = new_run_group(f"{node['run_id']}-{node['node_rank']}")

    def enter() -> None:
        become_subreaper()
        if group:
            join_group(group)

    keep_start(run_dir)
    log_fd = open_nofollow(os.path.join(run_dir, layout.LAUNCHER_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(log_fd, "ab") as log:   # a logs/ a rank replaced by a link is refused, not written through
        proc = subprocess.Popen(["/bin/bash", os.path.join(run_dir, "launch.sh")], cwd=run_dir, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=enter)
    tracked = bool(group) and in_group(proc.pid, group)
    if tracked:
        write_file(os.path.join(run_dir, layout.CGROUP), json.dumps(group), 0o600)
    else:
        remove_group(group)
    write_file(os.path.join(run_dir, layout.PGID), str(proc.pid))
    write_file(os.path.join(run_dir, layout.STARTED), str(time.time()))
    write_file(os.path.join(run_dir, layout.BOOT), boot_id() or "")
    from runctl import hardware

    hardware.baseline(run_dir)   # while the ranks still import: what the GPUs and ports counted before the run
    return {"pgid": proc.pid, "tracked_by": "cgroup" if tracked else "subreaper"}
