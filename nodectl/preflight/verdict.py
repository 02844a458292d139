"""The verdict every preflight check returns, and the helpers checks share to read a probe report: pure, no
node is read here."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Mapping

from nodectl.probe_report import ProbeReport
from nodectl.terminal_text import sized

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"


@dataclass(frozen=True)
class CheckResult:
    check: str
    node: str           # a node name, or "cluster" for cross-node checks
    verdict: str
    detail: str
    hint: str = ""
    env: Mapping[str, str] | None = None   # variables this hint recommends for hosts.yaml

    def to_json(self) -> dict:
        return asdict(self)


def unreadable(report, section: str) -> str | None:
    """Why a section of the probe report (a ProbeReport, or its JSON) holds no facts, or None: facts.py."""
    return ProbeReport.of(report).unreadable(section)


def result(node: str, verdict: str, detail: str, hint: str = "", env: Mapping[str, str] | None = None) -> CheckResult:
    """A verdict of the check being judged: its name is the one its `@check` declares, filled in as the judge
    returns (checks.py). A judge that speaks for another name (a helper shared by two checks, a declaration
    of several names) writes a CheckResult with that name instead."""
    return CheckResult("", node, verdict, detail, hint, env)


def named(results, name: str):
    """A judge's result(s), each still without a name given `name` (one CheckResult, a list of them, or None)."""
    if isinstance(results, CheckResult):
        return replace(results, check=name) if not results.check else results
    if isinstance(results, list):
        return [replace(r, check=name) if not r.check else r for r in results]
    return results


def skip_if_unreadable(check: str, section: str):
    """Decorator: a check of `section` facts returns skip with the reason when they could not be read."""
    def wrap(fn):
        def checked(node: str, report, *args, **kwargs) -> CheckResult:
            reason = unreadable(report, section)
            if reason:
                return CheckResult(check, node, SKIP, reason)
            return fn(node, report, *args, **kwargs)
        checked.__name__, checked.__doc__ = fn.__name__, fn.__doc__
        return checked
    return wrap


def gib(n: float) -> str:
    """A size in the unit that shows it: 1.0 MiB of /dev/shm, not "0.0 GiB"."""
    return sized(n)
