"""How a process of a several-process job meets the others: the ``env://`` rendezvous (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, as torchrun sets them) with a timeout of its own, and each way it
fails as one line naming the address: a port that is not a port, an address not set, a peer that never came
within the timeout. ``TORCHTITAN_EXT_RENDEZVOUS_TIMEOUT_S`` (seconds, default the process group's
``comm.timeout_seconds``) bounds the wait for the peers."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import tempfile
from collections.abc import Iterator

from torchtitan_ext.errors import UserError

RENDEZVOUS_TIMEOUT_ENV = "TORCHTITAN_EXT_RENDEZVOUS_TIMEOUT_S"


class RendezvousFailed(UserError):
    """The job's processes did not meet: the address, the timeout and what to check, in one line."""


def master_port() -> int | None:
    """``MASTER_PORT`` as a port number, None when unset; one line naming it when it is not one."""
    raw = os.environ.get("MASTER_PORT")
    if raw is None:
        return None
    try:
        port = int(raw.strip())
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise RendezvousFailed(f"environment variable MASTER_PORT={raw!r}: expected a port number, 1 to 65535")
    return port


def rendezvous_timeout(default_seconds: float) -> float:
    """Seconds to wait for every process: ``TORCHTITAN_EXT_RENDEZVOUS_TIMEOUT_S``, else ``default_seconds``."""
    raw = os.environ.get(RENDEZVOUS_TIMEOUT_ENV)
    if raw is None:
        return default_seconds
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise RendezvousFailed(f"environment variable {RENDEZVOUS_TIMEOUT_ENV}={raw!r}: expected a number of "
                               "seconds > 0")
    return seconds


def join(default_timeout_seconds: float):
    """(store, rank, world size) of this process once every process of the job has reached
    ``MASTER_ADDR:MASTER_PORT``; ``RendezvousFailed`` in one line otherwise."""
    import torch.distributed as dist

    port, addr = master_port(), os.environ.get("MASTER_ADDR")
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    where = f"rank {rank} of WORLD_SIZE={world}"
    if not addr or port is None:
        missing = " and ".join(n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not v)
        raise RendezvousFailed(f"environment variable {missing} not set: {where} meets the other processes at "
                               "MASTER_ADDR:MASTER_PORT (torchrun sets them; unset RANK and WORLD_SIZE for a plain "
                               "one-process run)")
    seconds = rendezvous_timeout(default_timeout_seconds)
    try:
        with _native_stderr_held():
            return next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=seconds)))
    except dist.DistError as e:
        reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        raise RendezvousFailed(f"rendezvous at {addr}:{port} ({where}) failed within {seconds:g} s "
                               f"({RENDEZVOUS_TIMEOUT_ENV}): {reason}; check that every process was started with "
                               "the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE and can reach that address") from None


@contextlib.contextmanager
def _native_stderr_held() -> Iterator[None]:
    """File descriptor 2 into a temporary file while the block runs. The C++ store logs each failed connect
    and its retry there, each with a native stack of some forty frames: written out on the real stderr when
    the block ends normally, dropped when it raises (the error's one line says what happened)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hold
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        ended_normally = False
        try:
            yield
            ended_normally = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if ended_normally:
                held.seek(0)
                kept = held.read()
                while kept:
                    kept = kept[os.write(2, kept):]
