"""The judge: every check that exists (each subject module imported, so each has declared its own with `@check`:
nodectl/preflight/checks.py), which run for a node and for the cluster at a tier, and their verdicts."""
from __future__ import annotations

from typing import Mapping

# Each subject module declares its checks as it is imported (in whatever order); SUBJECTS orders them, then each
# module's own order: the order of the preflight's output and of docs/PREFLIGHT.md's table.
from nodectl.preflight import cluster, gpu, history, host, network, storage
from nodectl.preflight.checks import MEASURED, REGISTRY, TIERS, Check, DocRow, Expectation, NodeFacts
from nodectl.probe_report import ProbeReport
from nodectl.preflight.verdict import CheckResult

SUBJECTS = tuple(m.__name__ for m in (host, gpu, network, storage, cluster, history))

__all__ = ["MEASURED", "TIERS", "Check", "Expectation", "NodeFacts", "checks_for", "doc_table", "judge_cluster",
           "judge_node"]


def registered() -> list[Check]:
    """Every declared check, by subject, then as written."""
    return sorted(REGISTRY, key=lambda c: (SUBJECTS.index(c.where[0]) if c.where[0] in SUBJECTS else len(SUBJECTS),
                                           c.where))


def checks_for(tier: str, device: str = "cuda") -> list[Check]:
    """The checks a preflight of this tier runs on a node of this device, then across the cluster."""
    return [c for c in registered() if tier in c.tiers and (device == "cuda" or not c.cuda_only)]


def _flat(verdicts: CheckResult | list[CheckResult]) -> list[CheckResult]:
    return verdicts if isinstance(verdicts, list) else [verdicts]


def judge_node(facts: NodeFacts, tier: str = "default") -> list[CheckResult]:
    """Every check of one node at this tier."""
    out: list[CheckResult] = []
    for check in registered():
        if check.scope != "node" or tier not in check.tiers or (check.cuda_only and facts.device != "cuda"):
            continue
        if check.needs and check.needs not in facts.extras:
            continue
        out += _flat(check.run(facts))
    return out


def judge_cluster(reports: Mapping[str, Mapping], devices: Mapping[str, str],
                  tier: str = "default") -> list[CheckResult]:
    """The cross-node checks over every reachable node's report."""
    cuda = any(d == "cuda" for d in devices.values())
    reports = {node: ProbeReport.of(report) for node, report in reports.items()}
    out: list[CheckResult] = []
    for check in registered():
        if check.scope == "cluster" and tier in check.tiers and (cuda or not check.cuda_only):
            out += _flat(check.judge(reports))
    return out


DOC_HEADER = ("| check | reads | verdict | threshold and source |", "| --- | --- | --- | --- |")


def doc_table() -> str:
    """docs/PREFLIGHT.md's table of checks, from the declarations (scripts/preflight_doc.py writes it there)."""
    rows: list[DocRow] = [row for check in registered() for row in check.doc]
    return "\n".join([*DOC_HEADER, *(f"| {r.label} | {r.reads} | {r.verdict} | {r.source} |" for r in rows)]) + "\n"
