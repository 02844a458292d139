"""Make the saved dumps the verdict tests read: every scenario under scenarios/ run for real (2 local nodes x 2
gloo ranks, through `nodectl launch`), diagnosed once it hangs, and each node's answer kept.

    .venv/bin/python tests/data/diagnose/capture.py OUT_FOLDER [SCENARIO...]

The answers hold this torch's flight-recorder format: tests/data/diagnose/torch-<version>/ has one folder per torch
met (the file `torch` in each says which and how it was made).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTLE = {"idle": 13.0}   # seconds after every rank printed its marker; idle waits for old heartbeats


def nodectl(project: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "nodectl", "-i", "hosts.yaml", *args], cwd=project,
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode not in (0, 1):
        raise SystemExit(f"nodectl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def capture(scenario: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as folder:
        project = Path(folder)
        shutil.copy(HERE / "scenarios" / f"{scenario}.py", project / f"{scenario}.py")
        (project / "hosts.yaml").write_text("defaults: {transport: local, device: cpu, gpus: 2}\n"
                                            "nodes:\n  - {name: node0, host: 127.0.0.1}\n"
                                            "  - {name: node1, host: 127.0.0.1}\n")
        nodectl(project, "launch", "--skip-preflight", "--detach", "--", f"{scenario}.py")
        try:
            deadline = time.monotonic() + 120
            while nodectl(project, "tail", "all", "-n", "50").stdout.count("hung from here") < 4:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{scenario}: the ranks never reached their marker")
                time.sleep(1)
            time.sleep(SETTLE.get(scenario, 8.0))
            verdict = json.loads(nodectl(project, "--json", "diagnose").stdout)
            target = out / scenario
            target.mkdir(parents=True, exist_ok=True)
            for path in Path(verdict["folder"] if Path(verdict["folder"]).is_absolute()
                             else project / verdict["folder"]).glob("node*.json"):
                shutil.copy(path, target / path.name)
            print(f"{scenario}: {verdict['kind']}: {verdict['summary']}")
        finally:
            nodectl(project, "stop", "--grace", "1", check=False)


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or sorted(p.stem for p in (HERE / "scenarios").glob("*.py"))
    import torch
    out.mkdir(parents=True, exist_ok=True)
    (out / "torch").write_text(f"torch {torch.__version__}, gloo ranks on CPU; made by "
                               f"tests/data/diagnose/capture.py on {time.strftime('%Y-%m-%d')}\n")
    for name in names:
        capture(name, out)


if __name__ == "__main__":
    main()
