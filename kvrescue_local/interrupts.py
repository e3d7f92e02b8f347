"""Ctrl-C ends a run wherever it lands: rc 130, one line on stderr, no traceback.

Python raises KeyboardInterrupt in whatever Python code runs when SIGINT arrives. Inside a function that
llama.cpp calls back through ctypes (its log, a load's progress) the exception cannot reach the caller: ctypes
prints "Exception ignored" and the C code goes on, so a model load ran to its end and the command after it. The
handler installed here therefore notes a Ctrl-C that lands inside such a callback instead of raising it there;
the load's progress callback then stops the load, and the runtime raises the noted interrupt (`raise_pending`)
once the C call has returned.
"""

from __future__ import annotations

import signal
import sys
import threading

INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a run ended by Ctrl-C
_callback_code: set = set()  # the code of every function llama.cpp calls back
_pending = False


def callback(function):
    """Mark function as one that C code calls through ctypes: a Ctrl-C inside it is noted, not raised."""
    _callback_code.add(function.__code__)
    return function


def _on_sigint(signum, frame) -> None:
    global _pending
    while frame is not None:
        if frame.f_code in _callback_code:
            _pending = True
            return
        frame = frame.f_back
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT as above (a no-op off the main thread, where Python allows no signal handler); idempotent."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) in (
            signal.default_int_handler, _on_sigint):
        signal.signal(signal.SIGINT, _on_sigint)


def pending() -> bool:
    """Whether a Ctrl-C landed in a callback and is not raised yet."""
    return _pending


def raise_pending() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that landed in a callback, after the C call returned."""
    global _pending
    if _pending:
        _pending = False
        raise KeyboardInterrupt


def exit_interrupted() -> None:
    sys.stderr.write("\ninterrupted\n")
    sys.exit(INTERRUPTED)
