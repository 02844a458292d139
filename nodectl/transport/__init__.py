"""The transport: connections to nodes (SSH or local), shell quoting, streams, and fan-out over many nodes with
one result per node. The bottom layer: it knows nodes (nodectl.inventory.Node) and nothing of runs, plans or
runctl; the node client (nodectl/remote/) is built on it.
"""
from nodectl.transport.channels import (DEFAULT_CONNECT_TIMEOUT, DEFAULT_FANOUT, CommandResult, CommandTimeout, Knock,
                                        LineStream, LocalTransport, NodeError, NodeErrorKind, StreamSink,
                                        TransferError, Transport, TransportOptions, Unreachable, quote_path)
from nodectl.transport.fanout import Cluster, FanOut, NodeFailure, NodeResult, Session, failure_of

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "DEFAULT_FANOUT", "Cluster", "FanOut", "CommandResult", "CommandTimeout", "Knock",
           "LineStream", "LocalTransport", "NodeError", "NodeErrorKind", "NodeFailure", "NodeResult", "Session",
           "StreamSink", "TransferError", "Transport", "TransportOptions", "Unreachable", "failure_of", "quote_path"]
