"""runctl's verbs, declared once. Each names the module of `runctl/` whose `cmd_<verb>` answers it, the trust rule
applied to its folders before it runs (runctl/dispatch.py: `GUARDS`), its answer's type on the controller
(nodectl/remote/answers.py builds `ANSWERS` from this table) and whether it reads a stream after its request.
The controller's `NodeClient` has a method of each public verb's name (tests/unit/test_layering.py holds the
sides to this table). Plain data: in runctl's artifact beside runlayout.py, imported by the controller.

Guards: `objects` (argv[0] is <workdir>/.nodectl/objects), `workdir` (argv[0] is <workdir>/.nodectl), `envs`
(<workdir>/.nodectl/envs), `run` (argv[0] is a run folder), `archive` (a run folder's collect archive), `prepare`
(the request's workdir and run folder), `store` (objects, and the run folder of a `prepare` sent along), `none`.
"""
from __future__ import annotations

from collections import namedtuple

Verb = namedtuple("Verb", "module guard answer stream internal", defaults=(False, False))

VERBS = {
    # the node and its store
    "identity": Verb("store", "workdir", "IdentityAnswer"),
    "have": Verb("store", "objects", "HaveAnswer"),
    "receive": Verb("store", "store", "ReceiveAnswer", stream=True),
    "env_status": Verb("envs", "workdir", "EnvAnswer"),
    "env_build": Verb("envs", "envs", "EnvAnswer"),
    "container": Verb("containers", "none", "ContainerAnswer"),
    # the network, for preflight and the master port
    "port": Verb("net", "none", "PortAnswer"),
    "listen": Verb("net", "none", "ListenAnswer"),
    "unlisten": Verb("net", "none", "Done"),
    "connect": Verb("net", "none", "ConnectAnswer"),
    "route": Verb("net", "none", "RouteAnswer"),
    # a run
    "prepare": Verb("runfolder", "prepare", "PrepareAnswer"),
    "pull": Verb("collect", "run", "PullAnswer"),
    "start": Verb("start", "run", "StartAnswer"),
    "poll": Verb("watch", "run", "PollAnswer"),
    "watch": Verb("watch", "run", "Done", stream=True),   # poll's answers as a stream of lines, until stdin ends
    "tail": Verb("watch", "run", "TailAnswer"),
    "stop": Verb("stop", "run", "StopAnswer"),
    "stacks": Verb("diagnose", "run", "StacksAnswer"),
    "diagnose": Verb("diagnose", "run", "DiagnoseAnswer"),
    "pack": Verb("collect", "run", "PackAnswer"),
    "fill": Verb("collect", "run", "FillAnswer", stream=True),
    "cleanup": Verb("collect", "archive", "Done"),
}
