"""What every ``python -m torchtitan_ext.<tool>`` shares: logging set-up and the one boundary that turns the
library's exception families into one ``error:`` line and an exit code. Library modules log through
``logging.getLogger(__name__)`` and raise; only entry points print and exit."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from torchtitan_ext.errors import RunStopped, UserError

EXIT_OK, EXIT_USER, EXIT_STOPPED = 0, 2, 3


class _CurrentStream(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time (a test's capture, or ``rank_log``'s tee)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stdout)
        super().emit(record)


def setup_logging(rank: int | None = None, log_file: str | Path | None = None) -> None:
    """The package's logger: rank 0 (``RANK``, default 0) prints its messages to the console as plain lines;
    with ``log_file`` every other rank writes its own to that file (rank 0's console lines reach its file
    through ``rank_log``)."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
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
        handler = logging.FileHandler(log_file)
    else:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)


def error_line(message: object) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def run_tool(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """Run ``main(argv)``; a user mistake is one line and exit code 2, a run that stopped itself one line and
    exit code 3. The process group, if one was started, is destroyed either way."""
    import torch.distributed as dist

    argv = sys.argv[1:] if argv is None else argv
    if not logging.getLogger("torchtitan_ext").handlers:
        setup_logging()
    try:
        return main(argv) or EXIT_OK
    except (UserError, FileNotFoundError, NotADirectoryError, argparse.ArgumentError) as e:
        error_line(e)
        return EXIT_USER
    except RunStopped as e:
        error_line(e)
        return EXIT_STOPPED
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def exit_now(code: int) -> None:
    """Leave without interpreter teardown once everything is flushed: gloo and pipeline-parallel runs that
    had finished every step were aborted there in CI ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
