"""The library's two exception families, which every entry point maps to one line and an exit code
(``torchtitan_ext/cli.py``). Library modules raise subclasses of these; anything else is a bug and keeps its
traceback. They live below every package, so a layer raises them without importing the one that reads them
(``ConfigError`` without the TOML loader). The exit codes are here too, one table for every entry point and
the tests that check them."""

from __future__ import annotations

import signal

EXIT_OK = 0  # done, or stopped by a preemption signal (after saving, or before anything was written)
EXIT_FAILED = 1  # an unexpected exception on one rank of a multi-process job: its traceback, then at once
EXIT_USER = 2  # a UserError: one line
EXIT_STOPPED = 3  # a RunStopped: the run protected its checkpoints
EXIT_OUT_OF_MEMORY = 4  # an OutOfDeviceMemory: one line (where, the peak, the plan, what would fit)
EXIT_INTERRUPTED = 128 + signal.SIGINT  # a second Ctrl-C (or one before the tool took the signal over): at once


class UserError(ValueError):
    """A mistake the user can fix (a config key, a file, a layout); its message is one line. Exit code 2."""


class RunStopped(RuntimeError):
    """The run stopped itself to protect its checkpoints (a NaN loss, non-finite gradients). Exit code 3."""


class OutOfDeviceMemory(RuntimeError):
    """The accelerator ran out of memory; the message is one line saying where and what would fit. Nothing
    saved is touched. Exit code 4."""


class ConfigError(UserError):
    """A bad config file, key or value; the message is one line meant for the user."""
