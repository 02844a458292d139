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
