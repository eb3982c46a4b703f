"""A program run in a pseudo-terminal, and the screen it draws.

`Terminal` starts a command on a pty of a given size (so it sees a real terminal: rich's Live redraws
in place with cursor movements) and feeds what it writes to `Screen`, a small VT100 screen model
(cursor moves, line and screen erases, scrolling; colours and other modes ignored): what a user would
see, not the raw byte stream with every earlier frame in it.
"""

from __future__ import annotations

import codecs
import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path
from typing import Callable, Optional

CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z@])")
OTHER_ESCAPE = re.compile(r"\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]")


class Screen:
    def __init__(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        self.lines = [[" "] * cols for _ in range(rows)]
        self.y = self.x = 0
        self._pending = ""

    def feed(self, text: str) -> None:
        text = self._pending + text
        self._pending = ""
        i = 0
        while i < len(text):
            ch = text[i]
            if ch == "\x1b":
                m = CSI.match(text, i) or OTHER_ESCAPE.match(text, i)
                if m is None:
                    if len(text) - i < 32:  # an escape cut by the read: wait for the rest
                        self._pending = text[i:]
                        return
                    i += 1
                    continue
                if m.re is CSI:
                    self._csi(m.group(1), m.group(2))
                i = m.end()
                continue
            if ch == "\r":
                self.x = 0
            elif ch == "\n":
                self._newline()
            elif ch == "\b":
                self.x = max(0, self.x - 1)
            elif ch >= " ":
                if self.x >= self.cols:
                    self.x = 0
                    self._newline()
                self.lines[self.y][self.x] = ch
                self.x += 1
            i += 1

    def _newline(self) -> None:
        if self.y == self.rows - 1:
            self.lines.pop(0)
            self.lines.append([" "] * self.cols)
        else:
            self.y += 1

    def _csi(self, params: str, command: str) -> None:
        if params.startswith("?"):
            return  # private modes (cursor visibility, ...)
        args = [int(p) if p else 0 for p in params.split(";")] if params else []
        n = max(args[0], 1) if args else 1
        if command == "A":
            self.y = max(0, self.y - n)
        elif command == "B":
            self.y = min(self.rows - 1, self.y + n)
        elif command == "C":
            self.x = min(self.cols - 1, self.x + n)
        elif command == "D":
            self.x = max(0, self.x - n)
        elif command == "G":
            self.x = min(self.cols - 1, n - 1)
        elif command in "Hf":
            row, col = (args + [1, 1])[:2]
            self.y, self.x = min(self.rows, max(row, 1)) - 1, min(self.cols, max(col, 1)) - 1
        elif command == "K":
            mode = args[0] if args else 0
            line = self.lines[self.y]
            start, end = {0: (self.x, self.cols), 1: (0, self.x + 1), 2: (0, self.cols)}[mode]
            line[start:end] = [" "] * (end - start)
        elif command == "J":
            mode = args[0] if args else 0
            if mode in (2, 3):
                self.lines = [[" "] * self.cols for _ in range(self.rows)]
            elif mode == 0:
                self.lines[self.y][self.x:] = [" "] * (self.cols - self.x)
                for row in range(self.y + 1, self.rows):
                    self.lines[row] = [" "] * self.cols

    def text(self) -> str:
        return "\n".join("".join(line).rstrip() for line in self.lines).strip("\n")


class Terminal:
    """`argv` on a `rows` x `cols` pseudo-terminal; `wait_for` reads until the screen shows something."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str], rows: int = 60, cols: int = 150) -> None:
        self.screen = Screen(rows, cols)
        self.output = ""
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "TERM")}
        self.process = subprocess.Popen(argv, cwd=cwd, stdin=slave, stdout=slave, stderr=slave,
                                        env={**env, "TERM": "xterm-256color"}, start_new_session=True)
        os.close(slave)
        self.master = master
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.closed = False

    def read(self, timeout_s: float) -> bool:
        """Feed what arrives within `timeout_s`; False once the program has closed the terminal."""
        if self.closed:
            return False
        ready, _, _ = select.select([self.master], [], [], timeout_s)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every writer has closed the pty
            data = b""
        if not data:
            self.closed = True
            return False
        text = self._decoder.decode(data)
        self.output += text
        self.screen.feed(text)
        return True

    def wait_for(self, predicate: Callable[[str], bool], timeout_s: float, what: str = "") -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self.screen.text()):
                return self.screen.text()
            if not self.read(0.2) and not predicate(self.screen.text()):
                break
        raise AssertionError(f"the screen never showed {what or predicate} (exit code {self.process.poll()}):\n"
                             f"{self.screen.text()}")

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        while self.read(0.2) and time.monotonic() < deadline:
            pass
        return self.process.wait(max(0.1, deadline - time.monotonic()))

    def interrupt(self) -> None:
        self.process.send_signal(signal.SIGINT)

    def close(self) -> Optional[int]:
        if self.process.poll() is None:
            self.process.kill()
        code = self.process.wait()
        os.close(self.master)
        return code
