"""Log streaming that holds at scale (issue 13): the node never stalls on a line without a newline, over-long
lines are cut with a marker, a \\r progress bar shows as its latest state, memory per rank stays bounded."""
from __future__ import annotations

import sys

from nodectl.remote.answers import parse
from nodectl.resources import resource_dir
from nodectl.transport import NodeResult
from nodectl.watch import LINE_MAX, LogStream

sys.path.insert(0, str(resource_dir("launchers")))
import runctl  # noqa: E402


def drain(path, stream: LogStream, rank: int = 0, polls: int = 500) -> None:
    """Poll the way `launch` does: runctl reads from the stream's offset, the stream takes what came back."""
    for _ in range(polls):
        offset = stream.offsets[rank]
        new, text = runctl.watch._read_from(str(path), offset)
        if new == offset:
            return
        stream.feed({"n": NodeResult(None, value=poll_answer({"logs": {str(rank): {"from": offset, "offset": new, "text": text}}}))})
    raise AssertionError("the stream did not reach the end of the log")


def collect(**kwargs) -> tuple[LogStream, list[str]]:
    lines: list[str] = []
    return LogStream({0: "n"}, lambda rank, line: lines.append(line), **kwargs), lines


def test_thirty_thousand_progress_updates_then_lines(tmp_path):
    log = tmp_path / "rank0.log"
    bar = "".join(f"\r{i:>6}/30000 [{'#' * (i * 20 // 30000):<20}]" for i in range(1, 30001))
    log.write_text(bar + "\n" + "".join(f"line {i}\n" for i in range(5)))
    stream, lines = collect()
    drain(log, stream)
    assert lines[-5:] == [f"line {i}" for i in range(5)]
    assert " 30000/30000" in lines[-6] and "\r" not in lines[-6]   # the bar's latest state
    assert len(lines) < 20                                          # not 30,000 states


def test_a_fifty_megabyte_line_is_cut_and_what_follows_is_shown(tmp_path):
    log = tmp_path / "rank0.log"
    with open(log, "w") as handle:
        handle.write("start\n" + "x" * (50 << 20) + "\nafter 1\nafter 2\n")
    stream, lines = collect()
    drain(log, stream)
    assert lines[0] == "start" and lines[-2:] == ["after 1", "after 2"]
    assert len(lines) == 4 and "line cut by nodectl" in lines[1] and len(lines[1]) < LINE_MAX + 100


def test_a_line_still_being_written_is_bounded_in_memory():
    stream, lines = collect()
    for _ in range(100):  # 100 polls of 256 KiB of one endless line
        stream.take(0, "y" * (256 << 10))
        assert len(stream.partial.get(0, "")) <= LINE_MAX
    stream.take(0, "tail of it\nnext line\n")
    assert lines[-1] == "next line" and "line cut by nodectl" in lines[0] and len(lines) == 2


def test_an_answer_to_an_older_request_is_not_shown_twice():
    stream, lines = collect()
    stream.feed({"n": NodeResult(None, value=poll_answer({"logs": {"0": {"from": 0, "offset": 6, "text": "hello\n"}}}))})
    stream.feed({"n": NodeResult(None, value=poll_answer({"logs": {"0": {"from": 0, "offset": 6, "text": "hello\n"}}}))})
    assert lines == ["hello"]


def poll_answer(fields: dict):
    """A runctl poll answer, through the same parser a real one goes through."""
    return parse("poll", {"now": 0.0, "node_rank": 0, "alive": 1, "ranks": [], **fields})


def test_a_progress_bar_is_shown_as_its_last_state_and_small_sizes_in_their_unit():
    """`tail` of a rank drawing a tqdm bar printed `\\r` escapes and cursor codes; 40 KiB sent read "0.0 MiB"."""
    from nodectl.terminal_text import sized, visible

    bar = "epoch 1:  10%|#         | 1/10\r epoch 1:  50%|#####     | 5/10\r\x1b[K epoch 1: 100%|##########| 10/10\r"
    assert visible(bar) == " epoch 1: 100%|##########| 10/10"
    assert visible("\x1b[2K\x1b[1Aloss 0.5 \x1b[32mok\x1b[0m") == "loss 0.5 \x1b[32mok\x1b[0m"   # colour kept
    assert visible("\x1b]52;c;ZXZpbA==\x07") == "\\x1b]52;c;ZXZpbA==\\x07"   # an OSC clipboard write still escaped
    assert [sized(n) for n in (0, 512, 40 << 10, 3 << 20, 5 << 30)] == ["0 B", "512 B", "40.0 KiB", "3.0 MiB",
                                                                       "5.0 GiB"]
