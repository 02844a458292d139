"""A fetched file's last bytes and the channel's end may arrive together, just after the reader looked and found
nothing: they must still be read (collect once failed with "0 of None bytes" on a busy machine)."""
from __future__ import annotations

from nodectl.transport.channels import _receive_file


class LateChannel:
    """paramiko's channel as the race leaves it: the first look finds no data; by the next, the file and the
    end have both arrived."""

    def __init__(self, payload: bytes) -> None:
        self.payload, self.looks = payload, 0

    def recv_ready(self) -> bool:
        self.looks += 1
        return self.looks > 1 and bool(self.payload)

    @property
    def eof_received(self) -> bool:
        return self.looks >= 1

    def recv(self, size: int) -> bytes:
        data, self.payload = self.payload[:size], self.payload[size:]
        return data


def test_data_that_arrives_with_the_end_is_read(tmp_path):
    body = b"x" * 1000
    channel = LateChannel(b"login banner\nNODECTL-FILE-ab 1000\n" + body)
    written, expected = _receive_file(channel, b"NODECTL-FILE-ab", tmp_path / "f", stall=5)
    assert (written, expected) == (1000, 1000)
    assert (tmp_path / "f").read_bytes() == body
