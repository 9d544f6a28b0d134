"""Every command-line tool of the package, by name:

    torchtitan-ext <tool> [arguments]                    (the console script pip installs)
    python -m torchtitan_ext.tools <tool> [arguments]    (the same as python -m torchtitan_ext.<tool>)

``torchtitan-ext <tool> --help`` describes one tool."""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

from torchtitan_ext import cli

# tool (as in ``python -m torchtitan_ext.<tool>``) -> (its module in torchtitan_ext.tools, what it does)
TOOLS: dict[str, tuple[str, str]] = {
    "train": ("train", "train a model from a job config (torchrun for several processes)"),
    "launch": ("launch", "torchrun for the trainer: the job checked first, restarts for crashes only"),
    "eval": ("eval", "validation loss and bits per byte of a job's checkpoint, as JSON"),
    "generate": ("generate", "continue prompts with a trained checkpoint"),
    "export": ("export", "a trained checkpoint as a Hugging Face folder"),
    "quant.export": ("quant_export", "8- or 6-bit per-row weights of a checkpoint, with their validation loss"),
    "plan": ("plan", "memory and communication per rank of a job, without a GPU"),
    "scaling": ("scaling", "fit a scaling law to runs; sweep widths x token budgets"),
    "mup.coord_check": ("coord_check", "muP coordinate check: layer output RMS across widths"),
    "data.prepare": ("prepare", "text, JSONL, parquet or conversation trees -> token shards"),
    "data.domains_corpus": ("domains_corpus", "a small multi-domain corpus from the machine's own text"),
    "distill.teacher": ("teacher", "a teacher checkpoint's top-k logits as sidecars for distillation"),
}


def _usage() -> str:
    width = max(map(len, TOOLS))
    return "\n".join([__doc__.strip(), "", "tools:", *(f"  {name:<{width}}  {what}" for name, (_, what) in
                                                      TOOLS.items())])


def _no_tool(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    raise cli.UsageError(f"{'unknown tool ' + repr(argv[0]) if argv else 'no tool given'}; expected one of: "
                         f"{', '.join(TOOLS)}")


def main(argv: list[str] | None = None) -> int:
    """Run the tool ``argv[0]`` names on the rest of ``argv``; its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in TOOLS:
        return cli.run_tool(_no_tool, argv)
    return importlib.import_module(f"torchtitan_ext.tools.{TOOLS[argv[0]][0]}").main(argv[1:])


def console_script() -> NoReturn:
    """The ``torchtitan-ext`` command (``[project.scripts]`` in pyproject.toml): :func:`main` on ``sys.argv``,
    left without interpreter teardown as the ``python -m`` shims leave (``cli.exit_now`` says why)."""
    cli.exit_now(main())


if __name__ == "__main__":
    console_script()
