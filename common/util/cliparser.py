"""The argument parser of every fedhop command: argparse's, with its errors on one line.

argparse answers a bad flag with the whole usage block and then the error (4 to 8 lines).  Every
fedhop command answers bad input with one line that names what was wrong and exits 2; the usage
stays one `--help` away, and the line says so.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose `error` is one line on stderr and exit status 2.  Its
    subparsers are of this class too (argparse makes them with the parent's class)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: a number from 0 to 65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port}: a number from 0 to 65535")
    return port


def folder_problem(given: str | os.PathLike, flag: str) -> str | None:
    """Why the folder a command's `flag` names (`given`) can be neither used nor made: a file is
    there, or a file is on the way to it (one line naming both); None when it can."""
    folder = Path(given).expanduser()
    if folder.exists() and not folder.is_dir():
        return f"{flag} {given}: a file, not a folder"
    blocked = next((p for p in folder.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        return f"{flag} {given}: {blocked} is a file, so no folder can be made under it"
    return None


def new_file_problem(given: str | os.PathLike, flag: str, suffix: str = "", force: bool = False) -> str | None:
    """Why a command cannot write the file its `flag` names (`given`): a folder is there, the name lacks
    `suffix` (e.g. ".png"), its folder does not exist, or a file is there already and `force` is False
    (nothing of the user's is replaced unasked); None when it can."""
    path = Path(given).expanduser()
    if path.is_dir():
        return f"{flag} {given} is a folder; name a file"
    if suffix and path.suffix.lower() != suffix:
        return f"{flag} {given}: name a {suffix} file"
    if not path.absolute().parent.is_dir():
        return f"{flag} {given}: no folder {path.absolute().parent}"
    if os.path.lexists(path) and not force:
        return f"{flag} {given}: a file is there; name another, or replace it with --force"
    return None


def figures_file_problem(given: str | os.PathLike | None, flag: str = "--json") -> str | None:
    """`new_file_problem` for a benchmark's figures file (an earlier one is replaced), or None when
    no file is named.  A benchmark writes its figures only when it ends, minutes or hours later,
    so the path is checked with its other flags: one it cannot write would lose them."""
    return new_file_problem(given, flag, force=True) if given else None


def new_folder_problem(given: str | os.PathLike, flag: str) -> str | None:
    """`folder_problem`, and a folder that is there and not empty (an earlier run, whose records a
    new one's would mix with, or files of the user's): for a command that writes a run into a new
    or empty folder and replaces nothing."""
    problem = folder_problem(given, flag)
    folder = Path(given).expanduser()
    if problem is None and folder.is_dir() and any(folder.iterdir()):
        problem = f"{flag} {given}: not empty (an earlier run, or files of yours); name a new or empty folder"
    return problem
