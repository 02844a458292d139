"""The object store's check: the bucket of an inventory's `outputs:` as each node will reach it (a probe object
written and deleted by the node itself, with its python and its env:). preflight/run.py runs the node side."""
from __future__ import annotations

from nodectl.preflight.checks import check
from typing import Mapping

from nodectl.preflight.verdict import FAIL, PASS, CheckResult, result


@check("outputs", "network", scope="job",
       doc=(("outputs (an inventory with `outputs:`)",
            "`launchers/nodectl_outputs.py check` with the node's Python and the AWS variables of its `env:` (on "
            "stdin, never a command line): a probe object written and deleted under the bucket's prefix",
            "fail when boto3 is missing for that Python, the credentials are refused, the bucket does not exist or "
            "the endpoint cannot be reached, with the client's words (secrets blanked)",
            "every tier; the node uploads the run's outputs itself, so an hour into a run is too late to learn it "
            "cannot"),))
def judge_store(answers: list[tuple[str, str, Mapping]]) -> list[CheckResult]:
    """(node, bucket url, the node's answer) each: {"ok": true, "seconds", "boto3"} or {"ok": false, "error"}."""
    checks = []
    for node, url, answer in answers:
        if answer.get("ok") is True:
            checks.append(result(node, PASS, f"wrote and deleted a probe object under "
                                 f"{url}/ in {answer.get('seconds', 0):.2f}s (boto3 {answer.get('boto3')})"))
        else:
            checks.append(result(node, FAIL, f"{url}: {answer.get('error')}",
                                 "the node uploads the run's outputs itself: it needs boto3 for its python:, "
                                 "credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in env:, or a "
                                 "profile on the node) and a route to the store (endpoint_url: for a server "
                                 "other than AWS)"))
    return checks
