"""A diagnosis quotes the program's own source lines (where a rank is, what it waits in) and its last log lines: a
token on one of them is masked where it stands, the rest of the line kept, on the terminal and on disk."""
from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from nodectl.cli.diagnose import print_diagnosis
from nodectl.diagnose.gather import Diagnosis
from nodectl.diagnose.verdicts import Verdict
from nodectl.secrets import redact_tree

TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz012345"


def test_a_token_on_a_quoted_source_line_is_masked_and_the_place_kept():
    verdict = Verdict("compute", f"stalled: rank 1 on node0 is stuck in compute at train.py:13 in `main` "
                                 f"(hub = HfApi(token='{TOKEN}'))", (1,),
                      (f"rank 1: at train.py:13 (hub = HfApi(token='{TOKEN}')), CPU 100%",), ("see the line",))
    view = SimpleNamespace(rank=1, log_tail=f"logging in with {TOKEN}\nstep 2\n")
    diagnosis = Diagnosis("r", verdict, (view,), None, 0.1)
    out = io.StringIO()
    print_diagnosis(SimpleNamespace(out=Console(file=out, width=200)), diagnosis)
    shown = out.getvalue()
    assert TOKEN not in shown and "train.py:13" in shown and "stuck in compute" in shown and "***" in shown
    stored = redact_tree({"summary": verdict.summary, "evidence": list(verdict.evidence)})
    assert TOKEN not in str(stored) and "train.py:13" in stored["summary"]
