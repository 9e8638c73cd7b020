"""Ending a child process by a signal mid-run, for the durability tests (the dump's and the monitor's)."""
from __future__ import annotations

import subprocess
import time


def signal_mid_run(args: list[str], env: dict, signum: int, after: int) -> tuple[int, str]:
    """Run `args` (a child printing the number of steps it ended after each step), send `signum`
    once it has ended `after` steps, and wait for it. Returns (steps it said it ended, stderr);
    asserts that the signal ended it (exit status -signum: the signal is not swallowed).

    stdout is unbuffered here (``bufsize=0``): its ``readline`` reads one byte at a time, so no
    line the child printed after the one read waits in a buffer that ``communicate`` (which
    reads the pipe's descriptor) never sees; a lost line made the child's count one too low."""
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, env=env)
    ended = 0
    deadline = time.monotonic() + 120
    while ended < after:
        assert child.poll() is None and time.monotonic() < deadline, "the child died or hangs"
        ended = int(child.stdout.readline())
    child.send_signal(signum)
    out, err = (stream.decode(errors="replace") for stream in child.communicate(timeout=120))
    assert child.returncode == -signum, err[-2000:]
    return max([ended, *(int(line) for line in out.split() if line.isdigit())]), err
