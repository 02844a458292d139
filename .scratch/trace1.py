import os, sys, time, shutil, tempfile, subprocess
from pathlib import Path
sys.path.insert(0, "/work/main/bench"); sys.path.insert(0, "/work/main/tests")
import sync as B
from sshcluster import SSHCluster
n=1; mb=1
root = Path(tempfile.mkdtemp(prefix="prof-")); project = root / "project"; (project / "code").mkdir(parents=True)
(project / "code" / "payload.bin").write_bytes(os.urandom(mb<<20))
(project / "quick.py").write_text("print('started')\n")
cluster = SSHCluster(root / "cluster", count=n, first_octet=120).start(); cluster.trust_host_keys()
inv = cluster.inventory(root / "hosts.yaml")
try:
    B.fresh_nodes(cluster, n)
    st = subprocess.Popen(["strace", "-f", "-ttt", "-e", "trace=execve,exit_group", "-o", "/tmp/st.txt", "-p", str(cluster.nodes[0].process.pid)])
    time.sleep(1)
    t0=time.time(); print("t0", t0)
    print(B.time_nodectl(cluster, inv, project, n, mb<<20))
    time.sleep(0.5); st.terminate(); st.wait()
finally:
    cluster.stop(); shutil.rmtree(root, ignore_errors=True)
