"""The command-line tools, on top of the library: one module per tool (its arguments, console lines and exit
code around library calls), the table of them in ``__main__.py`` (``python -m torchtitan_ext.tools <tool>``),
and a thin ``__main__`` shim per documented ``python -m torchtitan_ext.<tool>``. No library package imports
this one. Every tool parses with ``cli.ArgumentParser`` and returns ``cli.run_tool``'s exit code (one
``error:`` line for a user mistake); the shims end the process with ``cli.exit_now``."""
