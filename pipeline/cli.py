"""`arslice`: one console script dispatching subcommands from a table (`pipeline.runner.registry`).

A subcommand's module is imported only when it is chosen (`arslice --help` imports each for its
summary), and no module imports torch or transformers before it runs, so the CLI starts fast.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys

from ar_slicing import __version__
from ar_slicing.errors import ArSliceError
from pipeline.runner import registry

EPILOG = """examples:
  arslice tokenize --source val.jsonl.zst --tokenizer gpt2 --out runs/pile/tokens/val  # needs the hub
  arslice count --tokens runs/pile/tokens/train --out runs/pile/counts
  arslice tag --tokens runs/pile/tokens/val --counts runs/pile/counts --out runs/pile/tags
  arslice eval --model hf:EleutherAI/pythia-160m --tags runs/pile/tags --out runs/pile/losses/pythia-160m  # needs the hub
  arslice report --run runs/pile
  arslice query slice_perplexity --run runs/pile

Each subcommand has its own --help with examples, and --dry-run to print its resolved config."""


# the commands whose process trains, so its torch CPU kernels are pinned before torch loads
# (`models.cpu_kernels`); `arslice run` trains in processes it starts pinned
PINS_CPU_KERNELS = ("train",)


def top_level_help() -> str:
    commands = registry.commands()
    width = max(map(len, commands))
    lines = [
        f"usage: arslice COMMAND [options]   (ar-slicing {__version__})",
        "",
        "Associative-recall slicing of language-model perplexity.",
        "",
        "commands:",
    ]
    lines += [f"  {name.ljust(width)}  {c.summary}" for name, c in commands.items()]
    return "\n".join(lines) + "\n\n" + EPILOG


# what every command that writes an output says in its --help (`ar_slicing.machinery.ownership`)
OUTPUTS_NOTE = """\
outputs:
  One writer at a time: a second arslice writing the same output is refused at once (it does
  not wait), naming the pid of the one writing it. A stage removes only the files it wrote:
  any other file in its output folder makes it refuse, naming that file, --overwrite or not."""


def build_parser(name: str):
    """The argparse parser of subcommand `name`, and its Command."""
    from pipeline.config import add_config_arguments

    command = registry.command(name)
    epilog = ["examples:\n" + command.examples.strip("\n")] if command.examples else []
    if command.plan_settings is not None or name == "run":
        epilog.append(OUTPUTS_NOTE)
    parser = argparse.ArgumentParser(
        prog=f"arslice {name}",
        description=command.description or command.summary,
        epilog="\n\n".join(epilog) or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(parser, command.config_cls)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config and that its inputs exist, print the resolved config, and exit",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level",
    )
    return parser, command


def is_disk_full(err: OSError) -> bool:
    """True for a write refused for lack of space. pyarrow puts the errno in the text only, and
    numpy's `tofile` reports a short write ("N requested and M written") with no errno."""
    codes = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    text = str(err).lower()
    return (
        err.errno in codes
        or any(f"[errno {c}]" in text for c in codes)
        or (err.errno is None and "requested and" in text and "written" in text)
    )


def main(argv: list[str] | None = None) -> int:
    from pipeline.config import printing_summaries

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(top_level_help())
        return 0
    if argv[0] == "--version":
        print(f"ar-slicing {__version__}")
        return 0
    name = argv[0]
    if name not in registry.MODULES:
        print(f"arslice: unknown command {name!r}\n\n{top_level_help()}", file=sys.stderr)
        return 2
    parser, command = build_parser(name)
    ns = parser.parse_args(argv[1:])
    logging.basicConfig(
        level=getattr(logging, ns.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    with printing_summaries():
        return _run(name, command, ns)


def _run(name: str, command, ns) -> int:
    """Run the parsed command; an ArSliceError, an interrupt or a full disk become one line on
    stderr and an exit status."""
    from ar_slicing.errors import BadInput
    from pipeline.config import config_from_namespace, missing_inputs, print_config

    try:
        if name in PINS_CPU_KERNELS:
            from models import cpu_kernels

            cpu_kernels.pin()  # before anything loads torch
        cfg = config_from_namespace(command.config_cls, ns)
        if ns.dry_run:
            if command.dry_run is not None:
                command.dry_run(cfg)
                return 0
            if command.validate is not None:
                command.validate(cfg)
            missing = missing_inputs(command, cfg)
            if missing:
                raise BadInput("; ".join(missing) + " (nothing was run)")
            print_config(cfg)
            return 0
        command.run(cfg)
    except ArSliceError as e:
        print(f"arslice {name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"arslice {name}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except OSError as e:
        if not is_disk_full(e):
            raise
        print(
            f"arslice {name}: error: the disk is full ({e}); free space or choose an output on a "
            "larger disk, then rerun the same command (finished parts are kept)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
