"""Where a preflight check is declared: `@check` on the function that judges it, in its subject's module (host.py,
gpu.py, network.py, cluster.py, storage.py). The declaration holds all there is to know about the check besides its
code: its name (its results are `verdict.result(...)`, named from here as the judge returns) and subject, the
devices and tiers it runs at, what it is handed from the node's facts, the probe
section without which it skips, and its row(s) in docs/PREFLIGHT.md's table, which is generated from here (a test
holds the two equal). judge.py imports every subject module, so the registry is whole there, and runs it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Mapping

from nodectl.probe_report import ProbeReport
from nodectl.preflight.verdict import named, skip_if_unreadable



class Tier(str, Enum):
    """How deep a preflight goes: `quick` the probe's checks (a launch's gate, `--quick`); `default` adds the GPU
    job and the all-reduce over every node; `full` (`--full`) all-reduce sizes up to 4 GiB and node pairs. Equal
    to its name, as the checks' declarations and the records spell it."""
    QUICK = "quick"
    DEFAULT = "default"
    FULL = "full"

    def __str__(self) -> str:
        return self.value

    @property
    def measured(self) -> bool:
        """It runs the GPU job and the all-reduce job."""
        return self is not Tier.QUICK


TIERS = tuple(t.value for t in Tier)
MEASURED = tuple(t.value for t in Tier if t.measured)     # tiers that run the GPU job and the all-reduce job
SCOPES = ("node", "cluster", "job")


@dataclass(frozen=True)
class Expectation:
    """What the launch will ask of the nodes."""

    gpus: int | None          # ranks per node on cuda nodes (None: whatever each node has)
    master_port: int | None
    master_addr: str
    nodes: int = 1            # how many nodes the launch spans


@dataclass(frozen=True)
class NodeFacts:
    """What the checks of one node read: its probe report and the answers gathered for it."""

    node: str
    report: ProbeReport            # a mapping (the probe's JSON) is parsed into one here, once
    device: str
    expect: Expectation
    extras: Mapping = field(default_factory=dict)   # p2p (the GPU job), port, reach and route answers
    env: Mapping[str, str] = field(default_factory=dict)   # what the inventory sets for the node's ranks
    gpus: int | None = None                          # the node's `gpus:`
    medians: Mapping = field(default_factory=dict)   # per GPU model, the cluster's median GPU job figures
    addr: str = ""                                   # what the other nodes reach it by (inventory `addr:`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "report", ProbeReport.of(self.report))


@dataclass(frozen=True)
class DocRow:
    """One row of docs/PREFLIGHT.md's table."""

    label: str
    reads: str
    verdict: str
    source: str = "-"


@dataclass(frozen=True)
class Check:
    name: str
    subject: str                  # host, gpu, network, cluster
    judge: Callable
    scope: str = "node"           # node: judge(node, *given(facts)); cluster: judge(reports); job: judged by the
                                  # preflight run once its job ran (the all-reduce, the node pairs, the bucket)
    given: Callable[[NodeFacts], tuple] | None = None   # what a node check gets after the node's name (the report)
    cuda_only: bool = False
    tiers: tuple[str, ...] = TIERS
    needs: str | None = None      # an answer in NodeFacts.extras without which the check does not run
    doc: tuple[DocRow, ...] = ()
    where: tuple[str, int] = ("", 0)   # the declaring module and line: the order of the output and of the doc

    def run(self, facts: NodeFacts):
        return self.judge(facts.node, *(self.given(facts) if self.given else (facts.report,)))


REGISTRY: list[Check] = []


def check(name: str, subject: str, *, scope: str = "node", given: Callable[[NodeFacts], tuple] | None = None,
          cuda_only: bool = False, tiers: tuple[str, ...] = TIERS, needs: str | None = None,
          section: str | None = None, doc: tuple = ()):
    """Declare the decorated function a check. `section`: the probe report's section it reads; when the probe
    could not read that section, the check says skip with the reason (never pass). `doc`: (label, reads, verdict,
    source) per row of the table."""
    if scope not in SCOPES or any(t not in TIERS for t in tiers):
        raise ValueError(f"check {name!r}: scope {scope!r} or tiers {tiers!r} unknown")

    def register(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def judged(*args, **kwargs):
            return named(fn(*args, **kwargs), name)

        judge = skip_if_unreadable(name, section)(judged) if section else judged
        if any(c.name == name for c in REGISTRY):
            raise ValueError(f"check {name!r} is declared twice")
        REGISTRY.append(Check(name, subject, judge, scope, given, cuda_only, tuple(tiers), needs,
                              tuple(DocRow(*row) for row in doc), (fn.__module__, fn.__code__.co_firstlineno)))
        return judge
    return register
