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


def test_a_nodes_reason_drops_its_own_name_once_and_keeps_any_other():
    """Round four: a resume's pull error read `node1 could not take ...: node1: 1 file(s) ...`. `reason` is the
    error for a message that names the node itself; `said` names it once in front."""
    node = parse_inventory("nodes:\n  - {host: h0, name: node0}\n  - {host: h1, name: node1}\n").nodes[1]
    named = NodeResult.failed(node, "node1: 1 file(s) of output/ could not be brought")
    assert named.reason == "1 file(s) of output/ could not be brought" and named.said == named.error
    other = NodeResult.failed(node, "node0's output could not be read")
    assert other.reason == other.error and other.said == "node1: node0's output could not be read"
