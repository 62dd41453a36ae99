"""Ctrl-C that always ends the command with one line and status 130.

Python delivers SIGINT as a KeyboardInterrupt raised in whatever Python code runs next. When that
code is a weakref callback or a `__del__` (the graph and buffer caches use both), the interpreter
prints "Exception ignored in ..." and carries on: the interrupt is lost and a long run keeps going.
So, while a command runs, the handler raises as usual and also starts a short watchdog: if the
command has not reached its own Ctrl-C exit by then, the watchdog prints the same line and ends
the process itself. The handler and the hook that keeps the lost interrupt quiet are the
command's only: `handled()` puts the previous ones back when it returns (main() may run inside
another program, a test for one)."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

MESSAGE = "minigraph: interrupted"
EXIT_STATUS = 130
GRACE_S = 2.0            # time the normal KeyboardInterrupt path gets before the watchdog acts


class Interrupts:
    """One command's Ctrl-C: the line is printed once, by the command or by the watchdog."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reported = False
        self._timer = None

    def report(self) -> int:
        """Print the interrupt line (once) and stop the watchdog; the exit status to return."""
        with self._lock:
            if not self._reported:
                self._reported = True
                print(MESSAGE, file=sys.stderr, flush=True)
            if self._timer is not None:
                self._timer.cancel()
        return EXIT_STATUS

    def _watchdog(self):
        with self._lock:
            if self._reported:
                return
        self.report()
        os._exit(EXIT_STATUS)

    def on_sigint(self, signum, frame):
        with self._lock:
            if self._timer is None:
                self._timer = threading.Timer(GRACE_S, self._watchdog)
                self._timer.daemon = True
                self._timer.start()
        raise KeyboardInterrupt

    def close(self):
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()


def _quiet_lost_interrupts(default_hook):
    """The lost KeyboardInterrupt is not an error worth a traceback: the watchdog reports it."""
    def hook(unraisable):
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            default_hook(unraisable)
    return hook


@contextlib.contextmanager
def handled():
    """SIGINT through Interrupts for the duration of the block (main thread only, as Python
    requires, and only over Python's default handler: a host program's own handler stays)."""
    ctrl_c = Interrupts()
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield ctrl_c
        return
    previous_hook = sys.unraisablehook
    signal.signal(signal.SIGINT, ctrl_c.on_sigint)
    sys.unraisablehook = _quiet_lost_interrupts(previous_hook)
    try:
        yield ctrl_c
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.unraisablehook = previous_hook
        ctrl_c.close()
