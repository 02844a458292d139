"""`outputs:` in hosts.yaml (or `launch --outputs URL`): a run's outputs in an S3 bucket, sent by the nodes.

Each node uploads its output/, logs/ and metrics/ to <url>/<run id>/<node>/ while the run goes and once more when
it ends (launchers/nodectl_outputs.py, started by launch.sh beside torchrun, with boto3 on the node). A resumed
attempt pulls the run's outputs back to every node before its ranks start, so a run continues on fresh nodes;
`collect --from-store` brings them here when the nodes are gone. The URL is recorded; credentials never are:
they come from the node's environment (the inventory's env:) or its own AWS profile.
"""
from __future__ import annotations

import os
import sys
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from nodectl.errors import NodectlError, UsageError
from nodectl.sections import section
from nodectl.secrets import mask_url, url_secret

KEYS = {"url", "every", "endpoint_url", "region"}
DEFAULT_EVERY = 600.0
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$")
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


@dataclass(frozen=True)
class Outputs:
    url: str                        # s3://bucket/prefix, without a trailing slash
    every: float = DEFAULT_EVERY    # seconds between upload rounds
    endpoint_url: str | None = None # an S3-compatible server other than AWS (MinIO, Ceph, R2, ...)
    region: str | None = None

    def run_url(self, run_id: str) -> str:
        return f"{self.url}/{run_id}/"

    def node_config(self, run_id: str, node: str) -> dict:
        """lib/outputs.json on a node: what its uploader needs, and nothing secret."""
        return {**asdict(self), "run_id": run_id, "node": node}

    def to_json(self) -> dict:
        return asdict(self)


def url_problem(url: Any) -> str | None:
    """Why `url` cannot name where outputs go, or None. A URL echoed back has its credentials, query and fragment
    values masked (nodectl.secrets.mask_url): a refused presigned URL is not printed with its signature."""
    if isinstance(url, str):
        secret, url = url_secret(url), mask_url(url)
        if secret:
            return (f"an s3://bucket/prefix URL with no credentials in it (this one holds {secret}): the bucket's "
                    f"credentials come from the node's environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in "
                    f"env:) or its AWS profile, got {url!r}")
    if not isinstance(url, str) or not url.startswith("s3://"):
        return f"an s3://bucket/prefix URL, got {url!r}"
    if any(c in url for c in "\0\n\r\t ?#\\") or any(ord(c) < 32 for c in url):
        return f"an s3://bucket/prefix URL without spaces, control characters, ? or #, got {url!r}"
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if "@" in bucket or ":" in bucket:
        return ("an s3://bucket/prefix URL with no credentials or port in it: the bucket's credentials come from the "
                "node's environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in env:) or its AWS profile, and "
                "another server is named by endpoint_url:")
    if not BUCKET_RE.match(bucket) or ".." in bucket:
        return f"a bucket name of 3-63 lowercase letters, digits, '.' and '-', got {bucket!r}"
    if any(part in (".", "..") for part in prefix.strip("/").split("/") if part) or "//" in prefix.strip("/"):
        return f"a prefix without empty, '.' or '..' parts, got {prefix!r}"
    if len(url) > 512:
        return "a URL of at most 512 characters"
    return None


def seconds(value: Any) -> float | None:
    """'10m', '30s', '1h' or a number of seconds; None when it is none of these."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if 0 < value < float("inf") else None
    match = DURATION_RE.match(str(value))
    if not match:
        return None
    return float(match[1]) * {"s": 1, "m": 60, "h": 3600, None: 1}[match[2]]


def parse(value: Any, label: str, fail: Callable[[str, str], None]) -> Outputs | None:
    value = section(value, label, fail, shorthand="url", keys=KEYS, shape="an s3://bucket/prefix URL, or a mapping "
                    "with url: and every: (10m), endpoint_url:, region:")
    if value is None:
        return None
    if problem := url_problem(value.get("url")):
        fail(f"{label}.url", problem)
    every = seconds(value.get("every", DEFAULT_EVERY))
    if every is None or every < 1:
        fail(f"{label}.every", f"how often to upload: 30s, 10m, 1h or seconds (at least 1), got {value.get('every')!r}")
    endpoint = value.get("endpoint_url")
    if endpoint is not None and (not isinstance(endpoint, str) or not re.match(r"^https?://[^\s@?#]+$", endpoint)):
        shown = mask_url(endpoint) if isinstance(endpoint, str) else endpoint
        secret = url_secret(endpoint) if isinstance(endpoint, str) else None
        fail(f"{label}.endpoint_url", f"the server's http(s):// address alone, without credentials, query or "
             f"fragment{f' (this one holds {secret})' if secret else ''}: the bucket's credentials come from the "
             f"node's env: or AWS profile, got {shown!r}")
    region = value.get("region")
    if region is not None and (not isinstance(region, str) or not re.match(r"^[a-z0-9\-]{1,40}$", region)):
        fail(f"{label}.region", f"a region name (us-east-1), got {region!r}")
    return Outputs(url=value["url"].rstrip("/"), every=every, endpoint_url=endpoint, region=region)


def from_option(url: str, current: Outputs | None) -> Outputs:
    """`--outputs URL`: the inventory's other settings (every, endpoint_url, region) with another URL."""
    if problem := url_problem(url):
        raise UsageError(f"--outputs: {problem}")
    return replace(current, url=url.rstrip("/")) if current else Outputs(url=url.rstrip("/"))


def from_record(record: Any) -> Outputs | None:
    """A run record's outputs, checked like the inventory's (a record is data, not the user's word)."""
    def fail(key: str, expected: str) -> None:
        raise NodectlError(f"the run record's {key}: {expected}")
    return parse(record, "outputs", fail) if record else None


def _module():
    """launchers/nodectl_outputs.py, which the nodes run: the controller pulls from the bucket as a node does (boto3
    imported only when used)."""
    from nodectl.resources.launchers import nodectl_outputs
    return nodectl_outputs


def credentials_from(env: Mapping[str, str]) -> dict[str, str]:
    """The AWS variables among a node's env: (the inventory's secrets), for a client here."""
    return {name: env[name] for name in CREDENTIALS if env.get(name)}


@dataclass(frozen=True)
class Fetched:
    node: str
    files: int
    bytes: int
    folder: Path
    failed: tuple = ()   # {path, error} of each file the index lists that could not be brought (the rest was)
    failed_count: int = 0


def download_run(outputs: Outputs, run_id: str, nodes: list[str], destination: Path,
                 env: Mapping[str, str] | None = None) -> list[Fetched]:
    """What the store's index lists for each node of the run, into destination/<node>/ (collect --from-store).
    Credentials: the given env (the inventory's), else this machine's environment or AWS profile."""
    import importlib.util

    if importlib.util.find_spec("boto3") is None:   # said before the node-side helper prints its own answer
        raise NodectlError(f"collect --from-store reads the bucket from this machine, which has no boto3 for "
                           f"{sys.executable}: pip install 'nodectl[s3]' (or boto3)")
    module = _module()
    saved = {name: os.environ.get(name) for name in CREDENTIALS}
    os.environ.update(credentials_from(env or {}))
    try:
        fetched = []
        for node in nodes:
            folder = destination / node
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                answer = module.pull(str(folder), {"outputs": outputs.to_json(), "run_id": run_id,
                                                   "sources": [{"node": node}], "sections": module.SECTIONS})
            except Exception as exc:  # noqa: BLE001 - botocore's errors, said in words
                raise NodectlError(f"{outputs.run_url(run_id)}{node}/: {module.describe(exc)}") from None
            if not answer["indexed"].get(node):
                raise NodectlError(f"{outputs.run_url(run_id)}{node}/ holds no index: the node uploaded nothing "
                                   f"(nodectl status --run {run_id} shows its upload errors)")
            fetched.append(Fetched(node, answer["files"], answer["bytes"], folder, tuple(answer.get("failed") or ()),
                                   int(answer.get("failed_count") or 0)))
        return fetched
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
