"""Environment inputs are data (issue 40): a requirements file is wheels from an index, named; anything that
would run or read something else on the controller is refused by name before anything is built, and a file that
links out of the project is not read."""
from __future__ import annotations

import os

import pytest

from nodectl.environment import _read, check_requirements
from nodectl.errors import InventoryError, UsageError
from nodectl.inventory import parse_inventory


@pytest.mark.parametrize("line, words", [
    ("./vendor/mypkg", "is not a requirement by name"),
    ("/opt/src/mypkg", "is not a requirement by name"),
    (".", "is not a requirement by name"),
    ("mypkg @ https://example.invalid/mypkg-1.0.tar.gz", "direct reference, refused"),
    ("mypkg @ file:///tmp/mypkg", "direct reference, refused"),
    ("git+https://example.invalid/x.git#egg=x", "is not a requirement by name"),
    ("https://example.invalid/x-1.0.tar.gz", "is not a requirement by name"),
    ("-e ./mypkg", "-e is refused"),
    ("--editable=./mypkg", "--editable is refused"),
    ("-r other.txt", "-r is refused"),
    ("--index-url https://user:pw@example.invalid/simple", "--index-url is refused"),
    ("--find-links ./wheels", "--find-links is refused"),
    ("--pre", "the option --pre is not taken"),
    ("evilpkg-1.0.tar.gz", "names an archive file, refused"),   # pip took it as a local sdist: "ERROR: Exception:"
    ("evilpkg-1.0-py3-none-any.whl", "names an archive file, refused"),
])
def test_lines_that_are_not_wheels_from_an_index_are_refused_by_name(line, words):
    with pytest.raises(UsageError, match="line 2") as refused:
        check_requirements(f"torch==2.6.0\n{line}\n", "requirements.txt")
    assert words in str(refused.value)
    assert "pw" not in str(refused.value) or "pw@" not in str(refused.value)


def test_a_lock_with_hashes_markers_and_comments_is_taken():
    check_requirements("# a pip-compile lock\n"
                       "numpy==2.1.0 \\\n    --hash=sha256:aaaa \\\n    --hash=sha256:bbbb\n"
                       "pyyaml>=6 ; python_version >= '3.10'  # yaml\n\n"
                       "torch[cuda]==2.6.0\n", "requirements.lock")


def test_an_environment_file_linking_out_of_the_project_is_not_read(tmp_path):
    secret = tmp_path / "home" / ".ssh" / "id_ed25519"
    secret.parent.mkdir(parents=True)
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjE\n")
    project = tmp_path / "project"
    project.mkdir()
    os.symlink(secret, project / "requirements.txt")
    with pytest.raises(UsageError) as refused:
        _read(project, "requirements.txt")
    assert "link out of the project" in str(refused.value) and "BEGIN" not in str(refused.value)
    (project / "inside.txt").write_text("pyyaml\n")
    os.symlink(project / "inside.txt", project / "alias.txt")
    assert _read(project, "alias.txt")[0] == "pyyaml\n"


def test_an_index_password_is_refused_and_never_echoed():
    """One rule for every URL (round four): credentials in index_url are refused, not recorded masked: they would
    reach the nodes' pip command lines. The refusal names the key and echoes the URL masked."""
    for url in ("https://alice:s3cr3t-pw@pypi.example.invalid/simple",
                "https://pypi.example.invalid/simple?token=s3cr3t-pw"):
        with pytest.raises(InventoryError) as refused:
            parse_inventory("nodes:\n  - host: localhost\n    transport: local\n    device: cpu\n"
                            f"    environment: {{file: r.txt, install: index, index_url: '{url}'}}\n")
        said = str(refused.value)
        assert "environment.index_url" in said and "pip.conf" in said and "s3cr3t" not in said and "alice" not in said
