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


def test_the_pace_plot_shows_each_ranks_time_the_pace_and_the_straggler_verdict(tmp_path, monkeypatch):
    """runs/<id>/pace.jsonl (the windows an attached launch judged) becomes pace.png: a panel per share with a line
    per rank, the pace, and the straggler verdict shaded where it held; a script with no metrics of its own still
    gets it."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.figure

    from nodectl import report

    folder = tmp_path / "20261127-000000-abcd"
    (folder / "nodes" / "node0").mkdir(parents=True)   # collected, but the script wrote no metrics
    with open(folder / "pace.jsonl", "w") as out:
        for i in range(20):
            slow = 6 <= i < 12
            ranks = [{"rank": r, "busy": 0.9 if (r == 2 and slow) else 0.5, "wait": 0.1 if (r == 2 and slow) else 0.5,
                      "data": 0.4 if (r == 2 and slow) else 0.05} for r in range(4)]
            out.write(json.dumps({"time": 1000.0 + 5 * i, "pace": 0.6 if slow else 1.0, "rate": 2.0,
                                  "unit": "steps/s", "straggler": 2 if 7 <= i < 13 else None, "ranks": ranks}) + "\n")
        out.write("{cut by a crash\n")
    seen = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def remember(fig, path, *args, **kwargs):
        seen[path.stem] = [(a.get_ylabel(), len(a.get_lines()), len(a.patches)) for a in fig.axes]
        seen["pace_line"] = fig.axes[-1].get_lines()[0].get_ydata().tolist()
        return real_savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", remember)
    data = report.load_collected(folder)
    written = report.render(data, folder / "report")
    assert folder / "report" / "pace.png" in written and (folder / "report" / "pace.png").stat().st_size > 0
    assert [label for label, _, _ in seen["pace"]] == ["% computing", "% getting data", "% waiting for other ranks",
                                                       "pace (x healthy)"]
    assert [lines for _, lines, _ in seen["pace"][:3]] == [4, 4, 4]           # a line per rank
    assert all(patches == 1 for _, _, patches in seen["pace"])               # one verdict, shaded on every panel
    assert min(seen["pace_line"]) == 0.6 and seen["pace_line"][0] == 1.0
    assert report.summarise(data)["steps"] == 0


def test_rank_written_files_that_lie_cost_their_rows_never_the_report(tmp_path):
    """Round four: `report` crashed with a traceback on a metrics/rank0.jsonl holding a bare number and on a
    timing/rankX.jsonl. Every collected file is a rank's or node's word: a bad line, name or value costs itself."""
    from nodectl import report

    run = tmp_path / "run"
    node = run / "nodes" / "node0"
    (node / "metrics").mkdir(parents=True)
    (node / "timing").mkdir()
    rows = ["42", "[1, 2]", '"text"', '{"step": "3", "loss": 1.0}', '{"step": true, "loss": 1.0}',
            '{"step": 1e400, "loss": 1.0}', '{"step": 4, "loss": "NaN"}', '{"step": 5, "loss": Infinity}',
            '{"step": 6, "loss": ' + "9" * 400 + '}', '{"step": ' + "9" * 400 + ', "loss": 1.0}',
            '{"step": 1, "loss": 2.5, "custom": 1}', '{"step": 2, "loss": 2.0, "custom": 2}', "[" * 100_000]
    (node / "metrics" / "rank0.jsonl").write_text("\n".join(rows) + "\n")
    (node / "timing" / "rankX.jsonl").write_text('{"step": 1, "step_time_s": 1.0}\n')
    (node / "timing" / "rank1.jsonl").write_text('7\n{"step": 1, "step_time_s": 0.5}\n{"step": 2, "step_time_s": "x"}\n')
    (node / "metrics" / "telemetry.jsonl").write_text('{"time": "t", "gpus": 3}\n{"time": 1.0, "gpus": [5, {"util": "x"}]}\n'
                                                      '{"time": 2.0, "gpus": [{"gpu": 0, "util": 50}]}\n')
    (run / "pace.jsonl").write_text('{"time": 1e999, "ranks": 1}\n3\n')
    data = report.load_collected(run)
    assert sorted(data["timing"]) == [1]
    written = report.render(data, run / "report")
    assert {p.stem for p in written} >= {"loss", "step_time"}
    summary = report.summarise(data)
    assert summary["steps"] == 2 and summary["first_loss"] == 2.5 and summary["last_loss"] == 2.0
    assert summary["end_reason"] == "unknown"


def test_the_timeline_shows_each_attempt_its_failure_the_restart_and_the_checkpoints(tmp_path, monkeypatch):
    """timeline.png, from the goodput ledger (nodectl/goodput.py): a row per attempt with its set-up, start-up,
    training, the failure until nodectl noticed it and the restart; a tick per checkpoint on the attempt it fell in;
    the goodput and the lost time by kind in the title."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.figure

    from nodectl import goodput, report

    entries = [{"time": 1000.0, "what": "launch", "attempt": 0}, {"time": 1010.0, "what": "started", "attempt": 0},
               {"time": 1030.0, "what": "first step", "attempt": 0, "step": 1},
               {"time": 1032.0, "what": "beat", "attempt": 0, "step": 1},
               {"time": 1098.0, "what": "beat", "attempt": 0, "step": 34},    # 2 s a step
               {"time": 1100.0, "what": "failed", "attempt": 0, "kind": "rank"},
               {"time": 1103.0, "what": "noticed", "attempt": 0},
               {"time": 1110.0, "what": "started", "attempt": 1},
               {"time": 1110.0, "what": "continuing", "attempt": 1, "checkpoint": 30, "reached": 35},
               {"time": 1125.0, "what": "first step", "attempt": 1, "step": 31}]
    spent = goodput.ledger(entries, now=1200.0, ended=1200.0)
    metrics = [{"step": s, "loss": 1.0, "time": 1030.0 + 2 * s} for s in range(1, 36)]
    metrics += [{"step": s, "checkpoint_s": 0.5} for s in (10, 20, 30)]
    seen = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def remember(fig, path, *args, **kwargs):
        axis = fig.axes[0]
        seen[path.stem] = {"title": axis.get_title(), "rows": [t.get_text() for t in axis.get_yticklabels()],
                           "legend": [t.get_text() for t in axis.get_legend().get_texts()],
                           "bars": [(round(p.get_x(), 1), round(p.get_width(), 1)) for p in axis.patches],
                           "ticks": [line.get_xdata()[0] for line in axis.get_lines()]}
        return real_savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", remember)
    written = report.render({"metrics": metrics, "timing": {}, "telemetry": {}, "goodput": spent.to_json()},
                            tmp_path / "report")
    assert tmp_path / "report" / "timeline.png" in written
    shown = seen["timeline"]
    assert shown["rows"] == ["attempt 0", "attempt 1"]
    assert sorted(shown["legend"]) == sorted(["set-up", "start-up", "training", "work redone",
                                              "failed, not yet noticed", "restarting", "checkpoint"])
    # seconds since the launch: set-up 0-10, start-up 10-30, training 30-100, noticed at 103, restarted at 110
    # and attempt 1 did steps 31-35 again (5 steps of attempt 0's 2 s each) from 125
    assert {(0.0, 10.0), (10.0, 20.0), (30.0, 70.0), (100.0, 3.0), (103.0, 7.0), (110.0, 15.0),
            (125.0, 10.0)} <= set(shown["bars"]), shown["bars"]
    assert sorted(shown["ticks"]) == [50.0, 70.0, 90.0]   # steps 10, 20, 30 of attempt 0
    assert shown["title"].startswith(f"goodput {spent.share * 100:.0f}%; lost ") and "start-up" in shown["title"]
