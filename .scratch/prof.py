import os, sys, time, shutil, tempfile
from pathlib import Path
sys.path.insert(0, "/work/main/bench"); sys.path.insert(0, "/work/main/tests")
import sync as B
from sshcluster import SSHCluster

def node_cpu(cluster, n):
    tot = 0.0
    for node in cluster.nodes[:n]:
        f = open(f"/proc/{node.process.pid}/stat").read().rsplit(")", 1)[1].split()
        tot += sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")
    return tot

n = int(sys.argv[1]); mb = int(sys.argv[2]); which = sys.argv[3].split(",")
root = Path(tempfile.mkdtemp(prefix="prof-")); project = root / "project"; (project / "code").mkdir(parents=True)
size = mb << 20
with open(project / "code" / "payload.bin", "wb") as h:
    block = os.urandom(1 << 20)
    for i in range(mb): h.write(bytes([i % 256]) + block[1:])
(project / "quick.py").write_text("print('started')\n")
cluster = SSHCluster(root / "cluster", count=n, first_octet=120).start(); cluster.trust_host_keys()
inv = cluster.inventory(root / "hosts.yaml")
import subprocess
_orig_popen = subprocess.Popen
class TPopen(_orig_popen):
    def __init__(self, argv, *a, **k):
        if isinstance(argv, list) and argv[1:3] == ["-m", "nodectl"]:
            argv = [argv[0], "/work/main/.scratch/tnodectl.py"] + argv[3:]
        super().__init__(argv, *a, **k)
B.subprocess.Popen = TPopen
runs = {"nodectl": lambda: B.time_nodectl(cluster, inv, project, n, size),
        "scp-gcm": lambda: B.time_scp(cluster, project, n, size, "aes128-gcm@openssh.com"),
        "pdcp-gcm": lambda: B.time_pdcp(cluster, project, n, size, "aes128-gcm@openssh.com")}
try:
    for rep in range(int(os.environ.get("REPS", "1"))):
        for name in which:
            B.fresh_nodes(cluster, n); time.sleep(1)
            m0, c0, n0 = B.machine_cpu(), B.client_cpu(), node_cpu(cluster, n)
            smp = runs[name](); t, rss = smp.seconds, smp.rss
            m1, c1, n1 = B.machine_cpu(), B.client_cpu(), node_cpu(cluster, n)
            extra = open("/tmp/trace.txt").read() if name == "nodectl" else ""
            print(f"{name}: {t:.2f}s rss {rss>>20}MiB machine {m1-m0:.1f} sender {c1-c0:.1f} node {n1-n0:.1f} other {(m1-m0)-(c1-c0)-(n1-n0):.1f}\n{extra}", flush=True)
finally:
    cluster.stop(); shutil.rmtree(root, ignore_errors=True)
