"""The library's two exception families, which every entry point maps to one line and an exit code
(``torchtitan_ext/cli.py``). Library modules raise subclasses of these; anything else is a bug and keeps its
traceback. They live below every package, so a layer raises them without importing the one that reads them
(``ConfigError`` without the TOML loader)."""

from __future__ import annotations


class UserError(ValueError):
    """A mistake the user can fix (a config key, a file, a layout); its message is one line. Exit code 2."""


class RunStopped(RuntimeError):
    """The run stopped itself to protect its checkpoints (a NaN loss, non-finite gradients). Exit code 3."""


class ConfigError(UserError):
    """A bad config file, key or value; the message is one line meant for the user."""
