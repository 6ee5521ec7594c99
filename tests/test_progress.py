"""What a run shows as it goes: lines in a log or a pipe, one updating bar on a terminal."""

import fcntl
import os
import pty
import struct
import subprocess
import termios

from conftest import PYTHON


def test_a_terminal_gets_one_updating_bar_and_a_pipe_gets_lines():
    flags = ["-m", "minimp.train", "--steps", "40", "--log-every", "10", "--hidden", "16"]
    piped = subprocess.run([PYTHON, *flags], capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "\r" not in piped.stdout
    assert [line.split()[1] for line in piped.stdout.splitlines() if line.startswith("step")] == [
        "10/40",
        "20/40",
        "30/40",
        "40/40",
    ]
    leader, follower = pty.openpty()  # a pseudo-terminal: the process sees a person's screen
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100
    job = subprocess.Popen([PYTHON, *flags], stdout=follower, stderr=follower)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the process ended
            break
        if not chunk:
            break
        shown += chunk
    assert job.wait(timeout=120) == 0
    text = shown.decode(errors="replace")
    assert "\r" in text and "40/40" in text and "step/s" in text  # tqdm redraws one line
    assert "step    10/40" not in text and "done: 40 steps" in text
