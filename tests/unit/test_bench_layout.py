"""bench/ is laid out by what it measures, and the docs and bench/ agree: every `bench/...` path that a doc, a
bench README or a test names exists (a moved or removed script leaves no dead command behind), every script in a
subject folder is named by a command in docs/ or its folder's README (none left over, superseded and unnamed), and
every folder's README names each of its scripts."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUBJECTS = {"launch", "preflight", "trainer", "moe", "watch", "storage", "common"}
PATH = re.compile(r"(?<![\w/.])bench/[\w/]+\.(?:py|sh)\b")


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in out.stdout.split()]


def test_scripts_live_only_in_subject_folders():
    scripts = [p.relative_to(REPO / "bench") for p in tracked("bench") if p.suffix in (".py", ".sh")]
    assert scripts, "no bench scripts found"
    stray = [str(s) for s in scripts if s.parts[0] not in SUBJECTS]
    assert not stray, f"scripts outside bench's subject folders: {stray}"


def test_every_bench_path_named_anywhere_exists():
    named = {}
    for path in tracked("*.md", "*.py", "*.sh", "*.toml"):
        if path.is_file():
            for match in PATH.findall(path.read_text(errors="replace")):
                named.setdefault(match, path.relative_to(REPO))
    dead = {name: str(where) for name, where in named.items() if not (REPO / name).is_file()}
    assert named and not dead, f"bench paths named but not there (name: where): {dead}"


def test_every_script_is_named_by_the_docs_or_its_readme():
    docs = "".join(p.read_text() for p in tracked("docs/*.md", "README.md", "bench/*/README.md"))
    unnamed = []
    for script in tracked("bench/*.py", "bench/*.sh"):
        relative = script.relative_to(REPO).as_posix()
        if relative.startswith("bench/common/") or "/scripts/" in relative:
            continue   # helpers: named through the scripts that use them (the path test covers those names)
        if relative not in docs:
            unnamed.append(relative)
    assert not unnamed, f"bench scripts no doc or README names (superseded? remove them): {unnamed}"
    for folder in SUBJECTS - {"common"}:
        readme = (REPO / "bench" / folder / "README.md").read_text()
        missing = [p.name for p in (REPO / "bench" / folder).glob("*.[ps][yh]") if p.name not in readme]
        assert not missing, f"bench/{folder}/README.md does not name {missing}"
