"""A run's outputs to object storage, from the node itself (docs/REFERENCE.md §8): never through the controller.

Runs with the node's Python and the run's environment (its PYTHONPATH included: boto3 may come from there), which
needs boto3 (NODE_SETUP.md §2); boto3 does every transfer (multipart,
retries, signing). Credentials come from the run's environment (the inventory's env:, sourced from env.sh) or
the node's own AWS profile; no secret reaches a command line, a record or a message.

    python nodectl_outputs.py sync RUN_DIR        while the run goes: a round every `every` seconds, a last one
                                                  on SIGUSR1 (launch.sh sends it when torchrun has ended)
    python nodectl_outputs.py once RUN_DIR        one last round, now (bench/storage/outputs_upload.py)
    python nodectl_outputs.py pull RUN_DIR        before a resumed attempt starts: the run's outputs back
    python -c ... check                           preflight: write and delete a probe object

What is sent: the regular files under output/, logs/ and metrics/ of the run folder, to
<url>/<run id>/<node>/<same path>. A round sends what changed since the store last got it (size and mtime); a
file must have been still for QUIET seconds first, and one that changed while it was sent is not vouched for.
After each round the node's index object (INDEX) lists what the store holds consistently: a pull takes only
what the index lists, so an object a killed upload left (or a file caught mid-write) is never taken for a
checkpoint. Folders and files named *.tmp (a checkpoint being written) are never sent; a COMPLETE marker is sent
only after everything else in its folder. Files the run removed (old checkpoints it pruned) leave the store
too, after the index that no longer lists them.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time
import uuid


def _shared():
    """runlayout and nodeio: beside this file in lib/ on a node, or the controller's copies (collect
    --from-store). Imported when used: preflight's store check runs this file alone, from stdin."""
    try:
        import nodeio
        import runlayout
    except ImportError:
        from . import nodeio, runlayout
    return runlayout, nodeio

SECTIONS = ("output", "logs", "metrics")
INDEX = "nodectl-index.json"
MARKERS = ("COMPLETE",)
QUIET = 2.0                      # seconds a file must have been unchanged before it is sent
STATE = "state/upload.json"      # what `nodectl status` shows: last round, totals, the last error
SECRET_NAMES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


class NoBoto3(Exception):
    """This Python has no boto3: what the node's owner installs, said in the message."""

    def __init__(self) -> None:
        super().__init__(f"boto3 is not installed for {sys.executable} on this node: "
                         f"{sys.executable} -m pip install boto3")


def _import_boto3():
    try:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config
    except ImportError:
        raise NoBoto3() from None
    return boto3, TransferConfig, Config


def _answer(document: dict) -> int:
    print(json.dumps(document), flush=True)
    return 1 if document.get("error") else 0


def redact(text: str) -> str:
    """A client's message, with the values of the credentials in this environment blanked."""
    for name in SECRET_NAMES:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text[:500]


OBJECT_CALLS = ("HeadObject", "GetObject", "CopyObject", "GetObjectAttributes")   # a bare 404 from these: the object


def describe(exc: BaseException) -> str:
    """What went wrong, in words a user acts on (botocore's class names mean little)."""
    if isinstance(exc, NoBoto3):
        return str(exc)
    name = type(exc).__name__
    response = getattr(exc, "response", None) or {}
    code = (response.get("Error") or {}).get("Code")
    if name == "NoCredentialsError":
        return "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the inventory's env: (or a profile " \
               "on the node)"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "ExpiredToken"):
        return redact(f"the store refused the credentials ({code}): {exc}")
    if code == "NoSuchBucket":
        return redact(f"no such bucket ({code}): {exc}")
    if code in ("NoSuchKey", "NoSuchUpload") or code == "404" and getattr(exc, "operation_name", "") in OBJECT_CALLS:
        return redact(f"no such object ({code}): {exc}")
    if code == "404":
        return redact(f"not found, the bucket or what was asked in it ({code}): {exc}")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError"):
        return redact(f"the store cannot be reached: {exc}")
    return redact(f"{name}: {exc}")


class Store:
    """One node's place in the bucket: s3://bucket/prefix/<run id>/<node>/."""

    def __init__(self, config: dict, run_id: str | None = None, node: str | None = None) -> None:
        boto3, TransferConfig, Config = _import_boto3()
        url = config["url"]
        bucket, _, prefix = url[len("s3://"):].partition("/")
        self.bucket = bucket
        self.base = "/".join(part for part in (prefix.strip("/"), run_id, node) if part)
        settings = Config(retries={"max_attempts": 4, "mode": "standard"}, connect_timeout=10, read_timeout=120)
        self.client = boto3.client("s3", endpoint_url=config.get("endpoint_url") or None,
                                   region_name=config.get("region") or None, config=settings)
        # boto3's (and the AWS CLI's) own defaults: 10 requests at a time over every file of a round, 8 MiB parts;
        # larger parts and more requests were slower into one server (bench/storage/outputs_upload.py)
        self.transfer = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=10,
                                       use_threads=True)

    def key(self, relative: str, node_base: str | None = None) -> str:
        return f"{node_base if node_base is not None else self.base}/{relative}"

    def read_index(self, node_base: str | None = None) -> dict | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(INDEX, node_base))["Body"].read()
        except Exception as exc:  # noqa: BLE001 - a missing index is "nothing stored yet"; others are raised
            code = ((getattr(exc, "response", None) or {}).get("Error") or {}).get("Code")
            if code in ("NoSuchKey", "404"):
                return None
            raise
        index = json.loads(body)
        return index if isinstance(index, dict) and isinstance(index.get("files"), dict) else None

    def write_index(self, index: dict) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key(INDEX), Body=json.dumps(index).encode(),
                               ContentType="application/json")

    def abort_stale_parts(self) -> int:
        """Multipart uploads a killed uploader of this node left open: never visible as objects, but billed."""
        aborted = 0
        listing = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.base + "/")
        for upload in listing.get("Uploads") or []:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted += 1
        return aborted


def _still(path: str):
    """(size, mtime_ns, inode) of a regular file, never following a link; None otherwise."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_size, info.st_mtime_ns, info.st_ino) if stat.S_ISREG(info.st_mode) else None


def scan(run_dir: str) -> dict:
    """relative path -> (size, mtime_ns, inode) of every file a round may send."""
    found = {}
    for section in SECTIONS:
        top = os.path.join(run_dir, section)
        if os.path.islink(top) or not os.path.isdir(top):
            continue
        for folder, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if not d.endswith(".tmp") and not os.path.islink(os.path.join(folder, d)))
            for name in files:
                if name.endswith(".tmp") or ".nodectl-part-" in name:
                    continue
                path = os.path.join(folder, name)
                facts = _still(path)
                if facts is not None:
                    found[os.path.relpath(path, run_dir)] = facts
    return found


def _marker_blocked(relative: str, pending: set) -> bool:
    """A COMPLETE marker waits while anything else in its folder (or below) is not in the store yet."""
    folder = os.path.dirname(relative) + "/"
    return any(other.startswith(folder) and os.path.basename(other) not in MARKERS for other in pending)


class Uploader:
    def __init__(self, run_dir: str, config: dict) -> None:
        self.run_dir, self.config = run_dir, config
        self.every = max(1.0, float(config.get("every") or 600))
        try:
            self.store, self.missing = Store(config, config["run_id"], config["node"]), None
        except NoBoto3 as exc:   # a node without boto3 still records why it sends nothing (run())
            self.store, self.missing = None, str(exc)
        self.wake, self.final = threading.Event(), threading.Event()
        self.index: dict = {}      # relative -> {"size", "mtime_ns"}: what the store holds consistently
        self.borrowed = _borrowed(run_dir)   # node 0's files a resume brought here: node 0's uploader's to send
        self.state = {"url": f"{config['url'].rstrip('/')}/{config['run_id']}/{config['node']}/", "rounds": 0,
                      "files": 0, "bytes": 0, "last": None, "error": None, "error_time": None, "pid": os.getpid()}

    def _save_state(self) -> None:
        path = os.path.join(self.run_dir, STATE)
        tmp = f"{path}.{os.getpid()}.part"
        try:
            with open(tmp, "w") as handle:
                json.dump(self.state, handle)
            os.replace(tmp, path)
        except OSError:
            pass

    def _send_all(self, group: list) -> list:
        """Upload `group` through one transfer manager (its requests shared across the files, as `aws s3 sync`
        does); per file, its (size, mtime_ns) when what was sent is what the file still is, else None."""
        from boto3.s3.transfer import create_transfer_manager

        started = []
        with create_transfer_manager(self.store.client, self.store.transfer) as manager:
            for rel in group:
                path = os.path.join(self.run_dir, rel)
                before = _still(path)
                future = manager.upload(path, self.store.bucket, self.store.key(rel)) if before else None
                started.append((rel, path, before, future))
            results = []
            for rel, path, before, future in started:
                if future is None:
                    results.append((rel, None))
                    continue
                try:
                    future.result()
                except OSError:
                    if _still(path) is not None:
                        raise
                    results.append((rel, None))   # the run removed it while its parts were read: not an error
                    continue
                results.append((rel, before[:2] if _still(path) == before else None))
        return results

    def round(self, final: bool = False) -> None:
        now = time.time()
        found = {rel: facts for rel, facts in scan(self.run_dir).items()
                 if self.borrowed.get(rel) != list(facts[:2])}   # unless the run since wrote it itself
        wanted = {rel for rel, (size, mtime, _) in found.items()
                  if self.index.get(rel) != {"size": size, "mtime_ns": mtime}}
        # a file written in the last QUIET seconds waits for the next round (the last round takes everything)
        ready = {rel for rel in wanted if final or now - found[rel][1] / 1e9 >= QUIET}
        pending = set(wanted - ready)
        data = sorted(rel for rel in ready if os.path.basename(rel) not in MARKERS)
        markers = sorted(rel for rel in ready if os.path.basename(rel) in MARKERS)
        sent_files = sent_bytes = 0
        for group in (data, markers):
            if group is markers:   # a marker only once everything else of its folder is in the store
                held = [rel for rel in markers if _marker_blocked(rel, pending)]
                pending |= set(held)
                group = [rel for rel in markers if rel not in held]
            for rel in group:   # the index no longer vouches for what is being replaced
                self.index.pop(rel, None)
            for rel, facts in self._send_all(group):
                if facts is None and _still(os.path.join(self.run_dir, rel)) is None:
                    # removed by the run while it was sent (a checkpoint pruned meanwhile): what reached the
                    # store is vouched for by no index and no later round would remove it
                    self.store.client.delete_object(Bucket=self.store.bucket, Key=self.store.key(rel))
                    continue
                if facts is None:   # changed while it was sent: the next round tries again
                    pending.add(rel)
                    continue
                self.index[rel] = {"size": facts[0], "mtime_ns": facts[1]}
                sent_files, sent_bytes = sent_files + 1, sent_bytes + facts[0]
        gone = [rel for rel in self.index if rel not in found]
        for rel in gone:
            del self.index[rel]
        self.store.write_index({"files": self.index, "time": time.time(), "node": self.config["node"],
                                "run_id": self.config["run_id"]})
        for rel in gone:   # removed by the run (a pruned checkpoint): after the index stopped naming it
            self.store.client.delete_object(Bucket=self.store.bucket, Key=self.store.key(rel))
        self.state.update(rounds=self.state["rounds"] + 1, files=self.state["files"] + sent_files,
                          bytes=self.state["bytes"] + sent_bytes, last=time.time(), last_files=sent_files,
                          last_bytes=sent_bytes, stored=len(self.index), waiting=len(pending), final=final,
                          error=None)

    def _attempt_round(self, final: bool) -> None:
        try:
            self.round(final)
        except Exception as exc:  # noqa: BLE001 - the run goes on; the error is shown by `nodectl status`
            self.state.update(error=describe(exc), error_time=time.time())
        self._save_state()

    def run(self) -> int:
        signal.signal(signal.SIGUSR1, lambda *_: (self.final.set(), self.wake.set()))
        # SIGTERM (nodectl stop) reaches every process of the run: the ranks may still be writing their last
        # checkpoint, so the last round waits for launch.sh's SIGUSR1, sent once torchrun has ended.
        signal.signal(signal.SIGTERM, lambda *_: self.wake.set())
        self._save_state()   # its pid: `status` tells an uploader that was killed from one between rounds
        if self.missing:   # nothing can be sent this run: said where `status` and the launch look, then out
            self.state.update(error=self.missing, error_time=time.time(), ended=True)
            self._save_state()
            return _answer({"error": self.missing})
        try:
            stored = self.store.read_index()
            if stored:   # a resumed attempt: what the store already holds is not sent again
                self.index = {rel: facts for rel, facts in stored["files"].items() if isinstance(facts, dict)}
            self.store.abort_stale_parts()
        except Exception as exc:  # noqa: BLE001
            self.state.update(error=describe(exc), error_time=time.time())
            self._save_state()
        while not self.final.is_set():
            self._attempt_round(final=False)
            self.wake.wait(self.every)
            self.wake.clear()
        self.state["ended"] = True   # its last round was tried (its error, if any, says how it went)
        self._attempt_round(final=True)
        return 0


def _borrowed(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, _shared()[0].BORROWED), encoding="utf-8") as handle:
            found = json.load(handle)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _inside(run_dir: str, relative: str, sections) -> str | None:
    """The path `relative` names under one of `sections` of run_dir, or None for one that would leave it."""
    parts = relative.split("/")
    if parts[0] not in sections or len(parts) < 2 or any(p in ("", ".", "..") for p in parts) or "\0" in relative:
        return None
    folder = run_dir
    for part in parts[:-1]:
        folder = os.path.join(folder, part)
        if os.path.islink(folder):
            return None
    return os.path.join(run_dir, *parts)


def pull(run_dir: str, request: dict) -> dict:
    """Bring the run's output/ back from the store: first from this node's own place (what differs), then from
    node 0's (only what is missing here: a checkpoint a script wrote on rank 0 alone). Only what the index lists;
    `sections` (collect --from-store) may take logs/ and metrics/ too."""
    fetched, nbytes, sources, failed, borrowed = 0, 0, {}, [], {}
    for source in request["sources"]:   # a source may name a bucket of its own (node 0's, where nodes differ)
        store = Store(source["outputs"] if isinstance(source.get("outputs"), dict) else request["outputs"])
        base = "/".join(p for p in (store.base, request["run_id"], source["node"]) if p)
        index = store.read_index(base)
        sources[source["node"]] = 0 if index is None else len(index["files"])
        for relative, facts in sorted((index or {"files": {}})["files"].items()):
            target = _inside(run_dir, relative, request.get("sections") or ("output",))
            if target is None or not isinstance(facts, dict):
                continue
            here = _still(target)
            if here is not None and (source.get("missing_only") or here[:2] == (facts.get("size"), facts.get("mtime_ns"))):
                continue
            part = f"{target}.nodectl-part-{uuid.uuid4().hex[:8]}"
            try:
                os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
                store.client.download_file(store.bucket, store.key(relative, base), part, Config=store.transfer)
                if os.path.getsize(part) != facts.get("size"):
                    raise ValueError(f"the store holds {os.path.getsize(part)} bytes, its index {facts.get('size')}")
                if isinstance(facts.get("mtime_ns"), int):
                    os.utime(part, ns=(facts["mtime_ns"], facts["mtime_ns"]))
                os.replace(part, target)
            except Exception as exc:   # this file is not brought; what is here already stays as it was
                said = str(exc) if isinstance(exc, (ValueError, OSError)) else describe(exc)
                failed.append({"path": relative[:300], "error": said[:300]})
                continue
            finally:
                if os.path.lexists(part):
                    os.unlink(part)
            fetched, nbytes = fetched + 1, nbytes + facts.get("size", 0)
            if source.get("missing_only"):   # another node's file: not this node's uploader's to send again
                borrowed[relative] = list(_still(target)[:2])
    if borrowed:
        layout, nodeio = _shared()
        nodeio.update_json(os.path.join(run_dir, layout.BORROWED), borrowed)
    return {"files": fetched, "bytes": nbytes, "indexed": sources, "failed": failed[:50],
            "failed_count": len(failed)}


def check(request: dict) -> dict:
    """Preflight: this node can write and delete an object where the run's outputs go, with the credentials and
    the PYTHONPATH the run's environment will give the uploader."""
    env = request.get("env") or {}
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    sys.path[:0] = [p for p in (env.get("PYTHONPATH") or "").split(os.pathsep) if p]
    started = time.time()
    try:
        store = Store(request["outputs"])
        key = f"{store.base}/.nodectl-probe-{request.get('node', 'node')}-{uuid.uuid4().hex[:8]}".lstrip("/")
        store.client.put_object(Bucket=store.bucket, Key=key, Body=b"nodectl preflight probe\n")
        store.client.delete_object(Bucket=store.bucket, Key=key)
    except Exception as exc:  # noqa: BLE001 - every failure is the check's answer
        return {"ok": False, "error": describe(exc)}
    import boto3
    return {"ok": True, "seconds": round(time.time() - started, 3), "boto3": boto3.__version__}


def main(argv: list) -> int:
    if not argv:
        return _answer({"error": "usage: nodectl_outputs.py sync|pull RUN_DIR, or check"})
    verb = argv[0]
    if verb == "check":
        return _answer(check(json.loads(sys.stdin.read())))
    run_dir = os.path.abspath(argv[1])
    config = json.load(open(os.path.join(run_dir, "lib", "outputs.json")))
    if verb == "sync":
        return Uploader(run_dir, config).run()
    if verb == "once":   # one last round and out: what a launch's end does (bench/storage/outputs_upload.py times it)
        uploader = Uploader(run_dir, config)
        if uploader.missing:
            return _answer({"error": uploader.missing})
        stored = uploader.store.read_index()
        uploader.index = {rel: facts for rel, facts in ((stored or {}).get("files") or {}).items()
                          if isinstance(facts, dict)}
        uploader._attempt_round(final=True)
        return _answer({"error": uploader.state["error"]} if uploader.state["error"] else uploader.state)
    if verb == "pull":
        request = json.loads(sys.stdin.read() or "{}")
        try:
            return _answer(pull(run_dir, {**request, "outputs": config, "run_id": config["run_id"]}))
        except Exception as exc:  # noqa: BLE001 - the launch says which node could not get its outputs and why
            return _answer({"error": f"pulling the run's outputs from {config['url']}: {describe(exc)}"})
    return _answer({"error": f"unknown verb {verb!r}"})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
