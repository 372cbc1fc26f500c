"""Child processes that go when their parent does.

A server killed with SIGKILL runs no cleanup, so its child processes (the engine, the
tokenizer worker) must notice by themselves. On Linux the kernel signals them
(``PR_SET_PDEATHSIG``); elsewhere the engine also polls its parent's pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal


def die_with_parent(parent_pid: int) -> None:
    """Have this process killed (SIGKILL) when its parent exits, and exit now if the
    parent ``parent_pid`` is already gone (it may die before this call). The parent is the
    thread that started the process: start children from a thread that lives as long as
    the parent process."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(0)
