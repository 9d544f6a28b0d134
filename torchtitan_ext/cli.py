"""What every ``python -m torchtitan_ext.<tool>`` shares: logging set-up and the one boundary that turns the
library's exception families into one ``error:`` line and an exit code. Library modules log through
``logging.getLogger(__name__)`` and raise; only entry points print and exit."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from torchtitan_ext.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    EXIT_STOPPED,
    EXIT_USER,
    OutOfDeviceMemory,
    RunStopped,
    UserError,
)


class _CurrentStream(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time (a test's capture, or ``rank_log``'s tee)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout  # not setStream: it flushes the previous stream, which may be closed by now
        super().emit(record)


def setup_logging(rank: int | None = None, log_file: str | Path | None = None) -> None:
    """The package's logger: rank 0 (``RANK``, default 0) prints its messages to the console as plain lines;
    with ``log_file`` every other rank writes its own to that file (rank 0's console lines reach its file
    through ``rank_log``)."""
    if rank is None:
        rank = _launch_env().get("RANK", 0)  # RANK=abc: one line naming it, not int()'s traceback
    logger = logging.getLogger("torchtitan_ext")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if rank == 0:
        handler: logging.Handler = _CurrentStream()
    elif log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handler = _QuietFileHandler(log_file)
    else:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)


def _launch_env() -> dict[str, int]:
    """``parallel.dims.launch_env()``, imported (with torch) only when a launcher set one of its variables: a
    tool run by hand checks its arguments and paths before anything imports torch."""
    if not any(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        return {}
    from torchtitan_ext.parallel.dims import launch_env

    return launch_env()


class _QuietFileHandler(logging.FileHandler):
    """A rank's log file that never raises and prints no traceback when it cannot be written (a full disk):
    the failure is said once on stderr and the rank carries on."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            reason = sys.exc_info()[1]
            print(f"warning: cannot write the log file {self.baseFilename} ({reason}); this rank's log stops here",
                  file=sys.stderr, flush=True)


class UsageError(UserError):
    """A command-line mistake found by :class:`ArgumentParser`; one line, exit code 2."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; an :class:`OptionValue` shows its value as required (``--x N``, not ``[N]``)."""

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if isinstance(action, OptionValue):
            return str(self._metavar_formatter(action, default_metavar)(1)[0])
        return super()._format_args(action, default_metavar)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for tools whose mistakes are one ``error:`` line at :func:`run_tool` (exit code 2) rather than
    usage and message. Options are never abbreviated, so a ``--section.key`` override left for the config
    loader (``parse_known_args``) is never taken for one of the tool's own options."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


class OptionValue(argparse.Action):
    """An option taking one value (``nargs="?"`` underneath) whose absence is the config loader's line,
    ``argument --x: missing value``, instead of argparse's."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:
            raise UsageError(f"argument {option_string}: missing value")
        setattr(namespace, self.dest, values)


CONFIG_EPILOG = ("Any other --section.key value (or --section.key=value) overrides a key of the job config;\n"
                 "python -m torchtitan_ext.train --help lists them.")


def positive_number(raw: str) -> float:
    """argparse type: a finite number > 0 (``1e9`` allowed)."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {raw!r}")
    return value


def positive_whole(raw: str) -> int:
    """argparse type: a whole number > 0, also written ``1e6``."""
    value = positive_number(raw)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {raw!r}")
    return int(value)


class _ConfigOption(OptionValue):
    """``--config FILE`` once: a second is the config loader's line naming both files (argparse keeps the last)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from torchtitan_ext.config.loader import repeated_config

        if values is not None and (previous := getattr(namespace, self.dest, None)) is not None:
            raise repeated_config(previous, values)
        super().__call__(parser, namespace, values, option_string)


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``, the job's TOML file, read with its overrides by :func:`job_argv`."""
    parser.add_argument("--config", action=_ConfigOption, metavar="FILE",
                        help="the job's TOML config (train_configs/*.toml, or a dump folder's config.toml)")


def job_argv(ns: argparse.Namespace, rest: list[str]) -> list[str]:
    """The config loader's arguments (``parse_args``): ``--config FILE`` and the overrides argparse left."""
    return (["--config", ns.config] if ns.config is not None else []) + rest


def user_error(e: ValueError) -> UserError:
    """A ValueError of the input (an undecodable file, a bad number) as the user mistake it is."""
    return e if isinstance(e, UserError) else UserError(str(e))


def refusal(e: UserError | OSError | argparse.ArgumentError | RunStopped) -> tuple[str, int]:
    """The one ``error:`` line and the exit code for a user mistake, an OS refusal (a full disk, a read-only or
    forbidden path: the path and the system's reason) or a run that stopped itself."""
    if isinstance(e, OSError) and not isinstance(e, FileNotFoundError | NotADirectoryError):
        where = f"{e.filename}: " if e.filename else ""
        return f"error: {where}{e.strerror or e}", EXIT_USER
    return f"error: {e}", EXIT_STOPPED if isinstance(e, RunStopped) else EXIT_USER


@contextmanager
def sigint_raises() -> Iterator[None]:
    """Within it, SIGINT (Ctrl-C, ``kill -INT``) raises ``KeyboardInterrupt``, however the process was started.
    Python installs that handler at start-up only when SIGINT's action is the default; a process started with
    SIGINT ignored keeps ignoring it (the action is inherited across fork and exec): a background job of a
    non-interactive shell (``cmd &`` in a script, or in a CI job), or the child of a parent that ignored it.
    Such a tool would run through an interrupt to the end. A Python handler already in place (a caller's, a
    test's) is left alone; the previous action is put back on leaving."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL)):
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_tool(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """Run ``main(argv)`` with SIGINT raising ``KeyboardInterrupt`` (:func:`sigint_raises`); a user mistake is
    one line and exit code 2, a run that stopped itself one line and exit code 3, an interrupt the tool did not
    take over one line and exit code 130; the process group, if one was started, is destroyed. An unexpected
    exception on a rank of a multi-process job prints its traceback and ends the process at once (exit code
    1). torch is not imported here: a tool imports it after checking its arguments."""
    with sigint_raises():
        return _run_tool(main, sys.argv[1:] if argv is None else argv)


def _run_tool(main: Callable[[list[str]], int | None], argv: list[str]) -> int:
    try:
        _launch_env()  # WORLD_SIZE=abc: one line naming it, before any tool reads it
        if not logging.getLogger("torchtitan_ext").handlers:
            setup_logging()
        return main(argv) or EXIT_OK
    except OutOfDeviceMemory as e:  # one rank's: the others may wait in a collective it will never join
        print(f"error: {e}", file=sys.stderr, flush=True)
        if _process_group_size() > 1:
            exit_now(EXIT_OUT_OF_MEMORY)
        return EXIT_OUT_OF_MEMORY
    except (UserError, OSError, argparse.ArgumentError, RunStopped) as e:
        line, code = refusal(e)
        print(line, file=sys.stderr, flush=True)
        return code
    except KeyboardInterrupt:  # Ctrl-C where the tool has not taken over the signal (imports, config parsing)
        print("error: interrupted (SIGINT): stopped at once", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception:
        if _process_group_size() > 1:
            # The other ranks may wait in a collective or a pipeline receive this rank will never join, and
            # destroying an NCCL process group with work in flight waits for them, so the job would hang.
            # Leave at once instead; torchrun then stops the other workers.
            traceback.print_exc()
            exit_now(EXIT_FAILED)
        raise
    finally:
        if _process_group_size() > 0:
            sys.modules["torch.distributed"].destroy_process_group()


def _process_group_size() -> int:
    """The world size of the process group this process started, 0 when none (or torch was never imported)."""
    dist = sys.modules.get("torch.distributed")
    return dist.get_world_size() if dist is not None and dist.is_available() and dist.is_initialized() else 0


def exit_now(code: int) -> None:
    """Leave without interpreter teardown once everything is flushed: gloo and pipeline-parallel runs that
    had finished every step were aborted there in CI ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
