"""The command a `podshim` command line names, read without a parser (the warm helper's caller
and the parser of one command both need it)."""

from __future__ import annotations

from collections.abc import Sequence

# base.add_global_options' options that take a value, which is then no command name
_VALUE_OPTIONS = ("-r", "--runtime-endpoint", "--timeout", "-o", "--output")
_LONG_OPTIONS = ("--runtime-endpoint", "--timeout", "--output", "--help")


def command_of(argv: Sequence[str]) -> str | None:
    """The command `argv` names: its first word that is neither an option nor a global option's
    value. None when there is none, or when -h/--help or `--` comes first (`podshim -h` lists every
    command), or an option might be an abbreviation of a global one taking a value."""
    words = iter(argv)
    for word in words:
        if word == "--" or word.startswith("-h"):
            return None
        if word in _VALUE_OPTIONS:
            next(words, None)
        elif word.startswith("--"):
            if "=" not in word and any(o.startswith(word) for o in _LONG_OPTIONS):
                return None  # argparse's prefix matching: `--time 5` is --timeout, `--he` --help
        elif not word.startswith("-"):
            return word
    return None
