"""Everything that reaches a node from the controller: connections (ssh, transport), the runctl agent and its
typed answers, code sync, probing, starting and polling. Nothing outside this folder opens a connection."""
