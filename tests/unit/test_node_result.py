"""A node's error names the node once, whether the node's own message already starts with its name or not (an
environment build that failed said "n0: n0: ...")."""
from __future__ import annotations

from nodectl.errors import EXIT_USAGE, exit_code_for
from nodectl.inventory import parse_inventory
from nodectl.launch.job import StartFailed
from nodectl.transport import NodeFailure, NodeResult


def test_an_error_names_its_node_once():
    node = parse_inventory("nodes: [{host: a, name: n0}]").nodes[0]
    told = NodeResult.failed(node, "n0: environment requirements.txt: pip said no")
    bare = NodeResult.failed(node, "the command timed out")
    assert told.said == "n0: environment requirements.txt: pip said no"
    assert bare.said == "n0: the command timed out"
    assert str(StartFailed("r", [told, bare]).message).count("n0: n0") == 0


def test_an_unsafe_folder_is_a_usage_error():
    node = parse_inventory("nodes: [{host: a, name: n0}]").nodes[0]
    unsafe = NodeResult(node, failure=NodeFailure("unsafe", "n0: refusing to use /scratch/.nodectl: ..."))
    assert exit_code_for([unsafe, NodeResult(node, value=1)]) == EXIT_USAGE
    assert StartFailed("r", [unsafe]).exit_code == EXIT_USAGE


def test_a_runctl_call_that_times_out_names_its_node_and_verb_never_the_bootstrap_command():
    """`stop` at 32 nodes printed each node's whole 2,000-character bootstrap one-liner for a stop that did not
    finish in time; now one line with the node and the verb."""
    from nodectl.remote import agent
    from nodectl.transport import CommandTimeout, Transport, failure_of

    node = parse_inventory("nodes: [{host: a, name: node7}]").nodes[0]

    class Slow(Transport):
        runctl_seen = True

        def __init__(self) -> None:
            self.node = node

        def run(self, argv, *, stdin=None, timeout=None):
            raise CommandTimeout(f"{argv!r} did not finish within {timeout}s")

    try:
        agent.call(Slow(), "stop", "/w/runs/r1/node7", request={"grace": 5}, timeout=15)
    except CommandTimeout as exc:
        failure = failure_of(exc)
    said = NodeResult(node, failure=failure).said
    assert said == "node7: stop did not finish in 15 s", said
    assert "import" not in said and "runctl-" not in said
