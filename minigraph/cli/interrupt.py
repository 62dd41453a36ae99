"""Ctrl-C that always ends the command with one line and status 130.

Python delivers SIGINT as a KeyboardInterrupt raised in whatever Python code runs next. When that
code is a weakref callback or a `__del__` (the graph and buffer caches use both), the interpreter
prints "Exception ignored in ..." and carries on: the interrupt is lost and a long run keeps going.
So the handler raises as usual, and also starts a short watchdog: if the command has not reached
its own Ctrl-C exit by then, the watchdog prints the same line and ends the process itself."""
from __future__ import annotations

import os
import signal
import sys
import threading

MESSAGE = "minigraph: interrupted"
EXIT_STATUS = 130
GRACE_S = 2.0            # time the normal KeyboardInterrupt path gets before the watchdog acts

_lock = threading.Lock()
_reported = False


def report() -> int:
    """Print the interrupt line once (from the main path or the watchdog, whichever comes first)."""
    global _reported
    with _lock:
        if not _reported:
            _reported = True
            print(MESSAGE, file=sys.stderr, flush=True)
    return EXIT_STATUS


def _watchdog():
    with _lock:
        done = _reported
    if not done:
        report()
        os._exit(EXIT_STATUS)


def _on_sigint(signum, frame):
    timer = threading.Timer(GRACE_S, _watchdog)
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


def _quiet_lost_interrupts(default_hook):
    """The lost KeyboardInterrupt is not an error worth a traceback: the watchdog reports it."""
    def hook(unraisable):
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            default_hook(unraisable)
    return hook


def install():
    """Route SIGINT through the handler above (main thread only, as Python requires)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
        sys.unraisablehook = _quiet_lost_interrupts(sys.unraisablehook)
