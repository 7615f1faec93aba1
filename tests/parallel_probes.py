"""What the parallel tests observe about processes and sockets: signals this process sends, listen addresses."""

from __future__ import annotations

import os
import socket
from pathlib import Path


class SignalLog:
    """Records every ``os.kill`` this process makes with a real signal (not the 0 probe) while installed
    (``subprocess.Popen.kill`` goes through ``os.kill`` too)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, int]] = []
        real = os.kill

        def kill(pid: int, sig: int) -> None:
            if sig != 0:
                self.calls.append((pid, sig))
            real(pid, sig)

        monkeypatch.setattr(os, "kill", kill)


def listen_addresses(port: int) -> list[str]:
    """Local addresses of the LISTEN TCP sockets on ``port`` ("127.0.0.1", "0.0.0.0", "::" ...)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].rpartition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:
                out.append(_address(address))
    return out


def _address(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)                     # 32-bit words in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)
