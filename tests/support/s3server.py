"""A real S3-compatible server on loopback for the outputs: tests: moto's standalone server (the one s3fs's own
test suite runs), with its signature checks on, so a wrong secret is refused as AWS would refuse it.

Its first three requests are let through unsigned, to make a user with an s3:* policy and that user's access
key; from then on every request must be signed with a key the server issued.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REGION = "us-east-1"


def moto_available() -> bool:
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@dataclass
class S3Server:
    endpoint: str
    key_id: str
    secret: str
    process: subprocess.Popen

    @property
    def env(self) -> dict[str, str]:
        """What a node's env: holds to reach this store (the inventory's secrets)."""
        return {"AWS_ACCESS_KEY_ID": self.key_id, "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": REGION}

    def client(self, secret: str | None = None):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=self.key_id,
                            aws_secret_access_key=secret or self.secret)

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """key -> size of every object under prefix."""
        found, token = {}, None
        while True:
            page = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix,
                                                 **({"ContinuationToken": token} if token else {}))
            found.update({item["Key"]: item["Size"] for item in page.get("Contents") or []})
            token = page.get("NextContinuationToken")
            if not token:
                return found

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


@contextmanager
def s3_server(log: Path, host: str = "127.0.0.1"):
    import boto3

    port = _free_port(host)
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        env.pop(name, None)
    with open(log, "ab") as sink:
        process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                                   stdout=sink, stderr=subprocess.STDOUT, env=env)
    endpoint = f"http://{host}:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                with socket.create_connection((host, port), timeout=0.5):
                    break
            except OSError:
                if time.time() > deadline or process.poll() is not None:
                    raise RuntimeError(f"moto's server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.2)
        iam = boto3.client("iam", endpoint_url=endpoint, region_name=REGION, aws_access_key_id="bootstrap",
                           aws_secret_access_key="bootstrap")
        iam.create_user(UserName="nodectl-test")
        iam.put_user_policy(UserName="nodectl-test", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="nodectl-test")["AccessKey"]
        server = S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"], process)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
