"""`nodectl report` where matplotlib is missing: a usage error naming the extra, not a traceback."""
from __future__ import annotations


def test_report_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import builtins

    import pytest

    from nodectl import report
    from nodectl.errors import UsageError

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(UsageError, match=r"nodectl\[report\]"):
        report.render({}, tmp_path / "report")


def test_plots_carry_a_legend_a_log_loss_axis_and_throughput_from_zero(tmp_path, monkeypatch):
    """A user reads the plots: which line is which, a loss falling over orders of magnitude, and a tokens/s axis
    that starts at zero so that noise does not look like a collapse."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.figure

    from nodectl import report

    seen = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def remember(fig, path, *args, **kwargs):
        axis = fig.axes[0]
        seen[path.stem] = (axis.get_yscale(), axis.get_ylim()[0], axis.get_legend() is not None)
        return real_savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", remember)
    metrics = [{"step": s, "loss": 10.0 / s, "tokens_per_s_per_gpu": 5000 + (s % 3) * 10} for s in range(1, 40)]
    written = report.render({"metrics": metrics, "timing": {}, "telemetry": {}}, tmp_path / "report")
    assert {p.stem for p in written} == {"loss", "tokens_per_s"}
    assert seen["loss"][0] == "log" and seen["loss"][2]
    assert seen["tokens_per_s"][1] == 0 and seen["tokens_per_s"][2]
