"""Uploading a run's outputs from N nodes at once: nodectl's uploader against `aws s3 sync`, side by side in one
run, into one S3-compatible server on this machine (moto's, tests/support/s3server.py).

    python bench/storage/outputs_upload.py --nodes 4 --total-mb 2048 --repeats 2

Each "node" is a run folder of its own holding output/ with its share of the total (files of --file-mb, as a
checkpoint's shards are), written once before the timings. Per repeat and side, every node uploads at once:
  * nodectl: `python launchers/nodectl_outputs.py once RUN_DIR` per node: the last round a launch's end runs
    (scan, upload what the index lacks with boto3's transfer manager, the index object), from nothing in the
    bucket. This is the node-side code a run uses, not a copy of it.
  * reference: `aws s3 sync RUN_DIR/output s3://bucket/ref/<node>/output` per node, at the CLI's defaults (10
    requests at a time, 8 MiB parts) and tuned (--tuned: 20 at a time, 64 MiB parts, as nodectl uses): the faster
    of the two is the reference.
The bucket is emptied between passes (moto keeps objects in memory). Printed: seconds (wall clock, from the first
process started to the last one ended), MB/s in all, and nodectl's ratio to the reference (goal: at least 0.9x).
Both sides share this machine's cores with the server, so the figures are of this machine, side by side.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from support.s3server import s3_server  # noqa: E402

BUCKET = "bench-outputs"


def make_nodes(base: Path, nodes: int, total_mb: int, file_mb: int, endpoint: str) -> list[Path]:
    import json

    per_node = total_mb // nodes
    block = os.urandom(1 << 20)
    folders = []
    for n in range(nodes):
        run_dir = base / f"node{n}"
        for name in ("output/ckpt-0000100", "lib", "state", "logs", "metrics"):
            (run_dir / name).mkdir(parents=True, exist_ok=True)
        left, index = per_node, 0
        while left > 0:
            size = min(file_mb, left)
            path = run_dir / "output" / "ckpt-0000100" / f"shard-{index:03d}.bin"
            with open(path, "wb") as handle:
                for _ in range(size):
                    handle.write(block)
            os.utime(path, (time.time() - 60, time.time() - 60))
            left, index = left - size, index + 1
        (run_dir / "lib" / "outputs.json").write_text(json.dumps({
            "url": f"s3://{BUCKET}/ours", "every": 600, "endpoint_url": endpoint, "region": "us-east-1",
            "run_id": "bench", "node": f"node{n}"}))
        folders.append(run_dir)
    return folders


def timed(commands: list[list[str]], env: dict) -> float:
    started = time.perf_counter()
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    for proc, command in zip(procs, commands):
        out, err = proc.communicate()
        if proc.returncode != 0 or '"error": "' in out:
            raise SystemExit(f"{' '.join(command[:4])} failed ({proc.returncode}): {(out + err)[-800:]}")
    return time.perf_counter() - started


def empty(server) -> None:
    client = server.client()
    for key in server.objects(BUCKET):
        client.delete_object(Bucket=BUCKET, Key=key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--total-mb", type=int, default=2048)
    parser.add_argument("--file-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nodectl-outputs-bench-") as tmp, \
            s3_server(Path(tmp) / "moto.log") as server:
        server.bucket(BUCKET)
        folders = make_nodes(Path(tmp), args.nodes, args.total_mb, args.file_mb, server.endpoint)
        env = dict(os.environ, **server.env, AWS_CONFIG_FILE=str(Path(tmp) / "aws-config"))
        tuned_config = Path(tmp) / "aws-tuned"
        tuned_config.write_text("[default]\ns3 =\n  max_concurrent_requests = 20\n  multipart_chunksize = 64MB\n"
                                "  multipart_threshold = 64MB\n")
        ours = [[sys.executable, str(ROOT / "launchers" / "nodectl_outputs.py"), "once", str(f)] for f in folders]
        ref = [["aws", "s3", "sync", "--only-show-errors", "--endpoint-url", server.endpoint, str(f / "output"),
                f"s3://{BUCKET}/ref/{f.name}/output"] for f in folders]
        figures: dict[str, list[float]] = {"nodectl": [], "aws s3 sync (defaults)": [], "aws s3 sync (tuned)": []}
        for repeat in range(args.repeats):
            for name, commands, extra in (("nodectl", ours, {}),
                                          ("aws s3 sync (defaults)", ref, {}),
                                          ("aws s3 sync (tuned)", ref, {"AWS_CONFIG_FILE": str(tuned_config)})):
                for f in folders:   # every pass starts from nothing sent
                    (f / "state" / "upload.json").unlink(missing_ok=True)
                seconds = timed(commands, {**env, **extra})
                stored = sum(server.objects(BUCKET).values())
                empty(server)
                if stored < args.total_mb << 20:
                    raise SystemExit(f"{name}: only {stored} bytes reached the bucket")
                figures[name].append(seconds)
                print(f"repeat {repeat + 1} {name:24s} {seconds:7.2f} s  {args.total_mb / seconds:7.1f} MB/s",
                      flush=True)
        medians = {name: statistics.median(values) for name, values in figures.items()}
        best_ref = min(medians["aws s3 sync (defaults)"], medians["aws s3 sync (tuned)"])
        print(f"\n{args.nodes} nodes x {args.total_mb // args.nodes} MiB ({args.file_mb} MiB files), median of "
              f"{args.repeats}:")
        for name, value in medians.items():
            print(f"  {name:24s} {value:7.2f} s  {args.total_mb / value:7.1f} MB/s")
        print(f"  nodectl / best reference: {best_ref / medians['nodectl']:.2f}x the throughput (goal >= 0.9x)")


if __name__ == "__main__":
    main()
