"""model.compile's settings (trainer/model.py compile_settings): a checkpointed layer whose forward sets Python
state and puts it back, as transformers' hub-kernel wrapper does in every module it wraps, still compiles, in one
graph, to eager's result. Without the setting torch refuses the checkpointed forward, and the trainer's layer ran
uncompiled without a word; the trainer now says so after its first step (graph_breaks). Dynamo decides that,
whatever the backend: the tests compile with aot_eager (no C++ compiler run), the trainer with Inductor."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from support.trainer_import import trainer_module


class _Mode:
    """What the `kernels` package's CompileableContextVar does under torch.compile: its value set and put back, and
    a flag set that stays (it keeps the value in an attribute from then on)."""

    def __init__(self) -> None:
        self.value, self.compiled = None, False

    def set(self, value):
        previous, self.value, self.compiled = self.value, value, True
        return previous


MODE = _Mode()


def _forward(x):
    previous = MODE.set("hub kernels")
    try:
        return x.sin() * 2
    finally:
        MODE.set(previous)


def _layer(x):
    return checkpoint(_forward, x, use_reentrant=False)


@pytest.fixture
def dynamo():
    """torch's Dynamo settings, as the trainer's process starts; put back after the test."""
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor
    from torch._dynamo.utils import counters

    if not hasattr(dynamo, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        pytest.skip(f"torch {torch.__version__} has no such setting")
    MODE.__init__()   # as the wrapper starts: not yet used under torch.compile
    saved = (dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint, getattr(inductor, "emulate_precision_casts", None))
    dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint = False
    torch._dynamo.reset()
    counters.clear()
    yield dynamo
    dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint = saved[0]
    if saved[1] is not None:
        inductor.emulate_precision_casts = saved[1]
    torch._dynamo.reset()
    counters.clear()


def test_a_checkpointed_forward_that_sets_and_restores_python_state_compiles_in_one_graph(dynamo):
    model = trainer_module("model")
    with pytest.raises(Exception, match="side effect"):   # torch's refusal, as the trainer met it
        torch.compile(_layer, fullgraph=True, backend="aot_eager")(torch.randn(4, requires_grad=True))
    model.compile_settings("eager")
    torch._dynamo.reset()
    x = torch.randn(4, requires_grad=True)
    torch.compile(_layer, fullgraph=True, backend="aot_eager")(x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    assert MODE.value is None


def test_the_trainer_says_when_a_compiled_layer_ran_in_pieces(dynamo):
    """A checkpointed layer torch refuses (without the trainer's settings) runs uncompiled; the trainer's line after
    its first step says so, with torch's reason. With the settings nothing breaks and nothing is said."""
    from torch._dynamo.utils import counters

    model = trainer_module("model")
    for setting in (False, True):
        dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint = setting
        torch._dynamo.reset()
        counters.clear()
        torch.compile(_layer, backend="aot_eager")(torch.randn(4, requires_grad=True)).sum().backward()
        said = model.graph_breaks()
        if setting:
            assert said is None, said
        else:
            assert said and said.startswith("model.compile: ") and "graph break(s) by the first step" in said
            assert "side effect" in said and "TORCH_LOGS=graph_breaks" in said, said
