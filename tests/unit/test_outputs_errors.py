"""What the bucket client's errors are called (launchers/nodectl_outputs.py: describe): round four found a missing
object called "no such bucket". Built from botocore's own ClientError, as boto3 raises them."""
from __future__ import annotations

import pytest

botocore = pytest.importorskip("botocore.exceptions")

from nodectl.resources.launchers.nodectl_outputs import describe  # noqa: E402


def error(code: str, operation: str) -> Exception:
    return botocore.ClientError({"Error": {"Code": code, "Message": "Not Found"}}, operation)


@pytest.mark.parametrize("code, operation, words", [
    ("NoSuchKey", "GetObject", "no such object"),
    ("404", "HeadObject", "no such object"),
    ("NoSuchBucket", "ListObjectsV2", "no such bucket"),
    ("404", "HeadBucket", "not found, the bucket or what was asked"),
    ("AccessDenied", "GetObject", "the store refused the credentials"),
])
def test_a_store_error_is_called_what_it_is(code, operation, words):
    said = describe(error(code, operation))
    assert said.startswith(words) and f"({code})" in said
    if words != "no such bucket":
        assert "no such bucket" not in said
