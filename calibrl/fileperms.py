"""Modes of the files calibrl writes for other processes to read (models, checkpoints).

safetensors writes its files with mode 0600 whatever the umask, so a model saved by one
user cannot be read by another: a container running as its own uid (10001 in calibrl's
images) could not load a policy or judge model mounted from the host, nor a checkpoint
written by another uid. :func:`honour_umask` gives such files the mode a plain ``open()``
would have given them (0666 less the umask): with the usual umask 022 they are readable
by all, and a user who wants them private sets umask 077.
"""

from __future__ import annotations

import os
import pathlib


def current_umask() -> int:
    """The process umask, read without changing it (os.umask would, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    probe = pathlib.Path(os.getcwd()) / f".calibrl-umask-probe-{os.getpid()}"
    try:
        probe.touch(mode=0o666, exist_ok=False)
        return 0o777 & ~probe.stat().st_mode & 0o666
    finally:
        probe.unlink(missing_ok=True)


def honour_umask(folder: str | os.PathLike[str]) -> None:
    """Give every file under ``folder`` at least the permissions ``open()`` would grant
    under the current umask (never removes a permission a file already has)."""
    mode = 0o666 & ~current_umask()
    for path in pathlib.Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            current = path.stat().st_mode & 0o777
            if current | mode != current:
                path.chmod(current | mode)
