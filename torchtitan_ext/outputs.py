"""The one refusal of every tool that writes a new file or folder (``export --output``, ``quant.export
--output``): a path that already holds something is never overwritten, merged into or replaced; the tool
stops with one line naming the option and the path before it does any work. Light (no torch), so the tools
check it before their imports."""

from __future__ import annotations

from pathlib import Path

from torchtitan_ext.errors import UserError


class OutputExists(UserError):
    """The path a tool is to create already holds a file or a non-empty folder."""


def new_output(option: str, path: str | Path, *, folder: bool) -> Path:
    """``path`` expanded, once known to be free: absent (or, for a ``folder``, an empty folder); else
    ``OutputExists`` naming ``option`` and the path."""
    out = Path(path).expanduser()
    if folder:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise OutputExists(f"{option} {out}: exists and is not an empty folder (the tool writes a new one; "
                               f"remove it or name another path)")
    elif out.exists() or out.is_symlink():
        kind = "a folder" if out.is_dir() else "a file"
        raise OutputExists(f"{option} {out}: exists ({kind}); the tool writes a new file (remove it or name "
                           f"another path)")
    return out
