import os, sys, time, shutil, tempfile, subprocess, threading
from pathlib import Path
sys.path.insert(0, "/work/main/bench"); sys.path.insert(0, "/work/main/tests")
import sync as B, psutil
from sshcluster import SSHCluster
n=int(sys.argv[1]); mb=200
root = Path(tempfile.mkdtemp(prefix="prof-")); project = root / "project"; (project / "code").mkdir(parents=True)
with open(project / "code" / "payload.bin", "wb") as h:
    block = os.urandom(1 << 20)
    for i in range(mb): h.write(bytes([i % 256]) + block[1:])
(project / "quick.py").write_text("print('started')\n")
cluster = SSHCluster(root / "cluster", count=n, first_octet=120).start(); cluster.trust_host_keys()
inv = cluster.inventory(root / "hosts.yaml")
try:
    B.fresh_nodes(cluster, n)
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", str(inv), "launch", "--skip-preflight", "--detach", "--sync-limit", "100000", "--", "quick.py"], cwd=project, env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"self": 0, "kids_rss": 0, "kids_pss": 0, "self_pss": 0, "nkids": 0}
    stop = threading.Event()
    def sample():
        while not stop.is_set():
            try:
                p = psutil.Process(proc.pid); kids = p.children(recursive=True)
                peak["self"] = max(peak["self"], p.memory_info().rss)
                peak["self_pss"] = max(peak["self_pss"], p.memory_full_info().pss)
                r = s = 0
                for k in kids:
                    try: r += k.memory_info().rss; s += k.memory_full_info().pss
                    except psutil.Error: pass
                if r > peak["kids_rss"]: peak["kids_rss"], peak["kids_pss"], peak["nkids"] = r, s, len(kids)
            except psutil.Error: pass
            stop.wait(0.05)
    t = threading.Thread(target=sample); t.start()
    out, err = proc.communicate(); stop.set(); t.join()
    print(proc.returncode, err[-300:])
    print({k: (v >> 20 if k != "nkids" else v) for k, v in peak.items()})
    for p in psutil.process_iter():
        try:
            if "NODECTL_RUN_ID" in p.environ(): p.kill()
        except psutil.Error: pass
finally:
    cluster.stop(); shutil.rmtree(root, ignore_errors=True)
