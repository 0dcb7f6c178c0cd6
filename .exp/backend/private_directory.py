"""Directories and files that only the server's own user can use: the rendezvous areas live in one.

Why: a rendezvous area holds the job hub's authentication key and Unix socket, and the store through which
the ranks form their process group. A local user who could read the key could connect to the hub and inject
jobs; one who could create the rendezvous root first (it sits in /tmp by default) could read or plant files
there. So the root is made 0700, and an existing one is used only if this user owns it and no one else can
write to it; the files written in it are 0600.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIRECTORY_MODE = 0o700


class DirectoryNotPrivate(Exception):
    """A directory that should be this user's alone is not: another user owns it or may write to it."""


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "unknown user"


def make_private_directory(path: Path, setting: str) -> None:
    """Create directory `path` with mode 0700 if it does not exist, then check that it is private.

    `setting` names what chooses the path (e.g. an environment variable), for the error message.
    """
    try:
        path.mkdir(mode=PRIVATE_DIRECTORY_MODE, parents=True)
    except FileExistsError:
        pass
    check_private_directory(path, setting)


def check_private_directory(path: Path, setting: str) -> None:
    """Raise DirectoryNotPrivate unless `path` (and the link, if it is one) belongs to this user and no other user
    can write to it. A directory of ours that others may only read (as an older mdtriton made it) is made 0700."""
    uid = os.geteuid()
    advice = f"remove it, or set {setting} to a directory of your own"
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != uid:
        raise DirectoryNotPrivate(f"{path} is a symbolic link owned by {_user_name(link.st_uid)} (uid {link.st_uid}), "
                                  f"not by this server's user (uid {uid}); {advice}")
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise DirectoryNotPrivate(f"{path} is not a directory; {advice}")
    if info.st_uid != uid:
        raise DirectoryNotPrivate(f"{path} is owned by {_user_name(info.st_uid)} (uid {info.st_uid}), not by this "
                                  f"server's user (uid {uid}): another user could read the job hub's key there or "
                                  f"plant files; {advice}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DirectoryNotPrivate(f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): they could "
                                  f"plant files there; {advice} (chmod 700 {path} if you trust what is in it)")
    if stat.S_IMODE(info.st_mode) != PRIVATE_DIRECTORY_MODE:
        os.chmod(path, PRIVATE_DIRECTORY_MODE)


def open_private_file(path: Path, flags: int) -> int:
    """os.open(path, flags | O_CREAT), the file made 0600 (whether created now or before); returns the descriptor."""
    descriptor = os.open(path, flags | os.O_CREAT, PRIVATE_FILE_MODE)
    os.fchmod(descriptor, PRIVATE_FILE_MODE)
    return descriptor


def write_private_file(path: Path, text: str) -> None:
    """Replace `path` atomically (a renamed temporary file) by a 0600 file holding text."""
    temporary = path.with_suffix(".tmp")
    with os.fdopen(open_private_file(temporary, os.O_WRONLY | os.O_TRUNC), "w") as file:
        file.write(text)
    temporary.replace(path)
