import sys, time, os, atexit, threading
T0 = time.monotonic()
from nodectl import agent, launch
rec = []
CPU = {}
lock = threading.Lock()
def wrap(mod, name):
    orig = getattr(mod, name)
    def w(transport, command, *a, **k):
        s = time.monotonic()
        try: return orig(transport, command, *a, **k)
        finally:
            with lock: rec.append((command, s - T0, time.monotonic() - T0)); CPU[command] = os.times()[0] + os.times()[1]
    setattr(mod, name, w)
wrap(agent, "call"); wrap(agent, "call_stream")
def dump():
    by = {}
    for c, s, e in rec:
        d = by.setdefault(c, [1e9, 0, 0, 0]); d[0] = min(d[0], s); d[1] = max(d[1], e); d[2] += 1; d[3] += e - s
    with open(os.environ.get("TRACE_OUT", "/tmp/trace.txt"), "w") as f:
        f.write(f"imports {IMP:.2f}\n")
        for c, (s, e, n, tot) in sorted(by.items(), key=lambda x: x[1][0]):
            f.write(f"{c:10} first {s:6.2f} last_end {e:6.2f} n {n} mean {tot/n:.2f}\n")
        f.write(f"exit {time.monotonic()-T0:.2f} cpu at last start {CPU.get('start',0):.2f} cpu at exit {os.times()[0]+os.times()[1]:.2f}\n")
atexit.register(dump)
IMP = time.monotonic() - T0
from nodectl.cli import main
sys.argv[0] = "nodectl"
main()
