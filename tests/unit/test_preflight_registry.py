"""Every preflight check declares itself (`@check`): the judge runs the declarations, and docs/PREFLIGHT.md's table
is theirs, generated (scripts/preflight_doc.py) and held equal here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nodectl.preflight import checks, judge
from nodectl.preflight.checks import REGISTRY, Expectation, NodeFacts, check
from nodectl.preflight.verdict import PASS, SKIP, result
from nodectl.probe_report import ProbeReport

REPO = Path(__file__).resolve().parents[2]


def test_the_documented_table_is_the_declarations():
    doc = (REPO / "docs" / "PREFLIGHT.md").read_text()
    assert judge.doc_table() in doc, "docs/PREFLIGHT.md's table differs from the checks: python scripts/preflight_doc.py"


def test_every_check_is_declared_once_documented_and_runnable():
    names = [c.name for c in REGISTRY]
    assert len(names) == len(set(names))
    assert {c.subject for c in REGISTRY} == {"host", "gpu", "network", "cluster"}
    assert all(c.doc for c in REGISTRY), [c.name for c in REGISTRY if not c.doc]
    assert {"collective, nccl transport", "node pairs", "outputs", "history", "stragglers", "hardware"} == \
        {c.name for c in REGISTRY if c.scope == "job"}


def test_a_new_check_is_one_declaration(monkeypatch):
    """What a newcomer writes: one function with its declaration; the judge runs it at its tiers, gives it what it
    asked for, names its results as declared (the name is written once), skips it (never passes) where its probe
    section could not be read, and documents it."""
    monkeypatch.setattr(checks, "REGISTRY", list(REGISTRY))
    monkeypatch.setattr(judge, "REGISTRY", checks.REGISTRY)

    @check("swap size", "host", given=lambda f: (f.report, f.env), section="memory", tiers=("default", "full"),
           doc=(("swap size", "`/proc/meminfo` SwapTotal", "warn when none", "-"),))
    def check_swap_size(node, report, env):
        return result(node, PASS, f"{report.memory.swap_total_bytes} bytes of swap, env {sorted(env)}")

    facts = NodeFacts("n0", {"memory": {"swap_total_bytes": 4}}, "cpu", Expectation(None, None, "10.0.0.1"),
                      env={"A": "1"})
    found = {r.check: r for r in judge.judge_node(facts, "default")}
    assert found["swap size"].verdict == PASS and found["swap size"].detail == "4 bytes of swap, env ['A']"
    direct = check_swap_size("n1", ProbeReport.of({"memory": {"swap_total_bytes": 0}}), {})   # called directly too
    assert direct.check == "swap size"
    assert "swap size" not in {r.check for r in judge.judge_node(facts, "quick")}
    unread = NodeFacts("n0", {"memory": {"error": "denied"}}, "cpu", Expectation(None, None, "10.0.0.1"))
    assert {r.check: r for r in judge.judge_node(unread)}["swap size"].verdict == SKIP
    assert "| swap size | `/proc/meminfo` SwapTotal | warn when none | - |" in judge.doc_table()
    with pytest.raises(ValueError, match="declared twice"):
        check("swap size", "host")(check_swap_size)
    with pytest.raises(ValueError, match="unknown"):
        check("other", "host", tiers=("nightly",))


def test_the_doc_script_rewrites_only_the_table(tmp_path):
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("preflight_doc", REPO / "scripts" / "preflight_doc.py")
    script = module_from_spec(spec)
    spec.loader.exec_module(script)
    text = "# title\n\nbefore\n\n" + judge.DOC_HEADER[0] + "\n" + judge.DOC_HEADER[1] + "\n| old | row | x | y |\n\nafter\n"
    new = script.replaced(text)
    assert new.startswith("# title\n\nbefore\n\n") and new.endswith("\n\nafter\n") and "| old |" not in new
    assert judge.doc_table() in new
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "preflight_doc.py"), "--check"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0 and "already current" in out.stdout, out.stdout + out.stderr
