"""The rendezvous root is this user's alone: created 0700, refused when another user owns it or may write to it;
the hub's key (state.json), the lock, the process-group store and the hub's socket are 0600."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from mdtriton.backend.job_hub import JobHub
from mdtriton.backend.private_directory import DirectoryNotPrivate, check_private_directory, make_private_directory
from mdtriton.backend.rendezvous import ROOT_ENV, Rendezvous

OTHER_UID = 65534  # nobody


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def someone_elses_directory(tmp_path: Path) -> Path:
    """A directory owned by another user: made and given away when running as root, else the root directory."""
    if os.geteuid() != 0:
        return Path("/")
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, OTHER_UID, OTHER_UID)
    return directory


def test_the_root_is_created_private_and_every_file_in_it_is_0600(tmp_path):
    root = tmp_path / "deep" / "r"
    area = root / "a"
    ranks = [Rendezvous(area, rank, 2) for rank in range(2)]
    number = [rank.enter() for rank in ranks][0]
    assert mode(root) == 0o700 and mode(area) == 0o700 and mode(area / f"epoch{number}") == 0o700
    for name in ("state.json", "lock", f"epoch{number}/store"):
        assert mode(area / name) == 0o600, name
    hub = JobHub(str(area / f"epoch{number}" / "hub"), "token", 2).start()
    try:
        assert mode(area / f"epoch{number}" / "hub") == 0o600
    finally:
        hub.stop()
    for rank in ranks:
        rank.leave(number)


def test_a_root_owned_by_another_user_is_refused_naming_it(tmp_path):
    theirs = someone_elses_directory(tmp_path)
    uid = os.stat(theirs).st_uid
    with pytest.raises(DirectoryNotPrivate, match=rf"{theirs} is owned by .* \(uid {uid}\), not by this server's user"
                                                   rf".*set {ROOT_ENV} to a directory of your own"):
        Rendezvous(theirs / "a", 0, 2).enter()
    assert not (theirs / "a").exists()


@pytest.mark.parametrize("loose_mode", [0o777, 0o1777, 0o720], ids=oct)
def test_a_root_others_may_write_to_is_refused(tmp_path, loose_mode):
    root = tmp_path / "r"
    root.mkdir()
    os.chmod(root, loose_mode)
    with pytest.raises(DirectoryNotPrivate, match=rf"is writable by other users \(mode {loose_mode:o}\)"):
        Rendezvous(root / "a", 0, 2).join(1, threading.Event())
    assert list(root.iterdir()) == []


def test_a_root_of_ours_that_others_may_read_is_made_private(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    os.chmod(root, 0o755)  # as an older mdtriton made it
    make_private_directory(root, ROOT_ENV)
    assert mode(root) == 0o700


def test_a_link_owned_by_another_user_or_a_file_is_refused(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(ours)
    check_private_directory(link, ROOT_ENV)  # a link of our own to a directory of our own is fine
    if os.geteuid() == 0:
        os.lchown(link, OTHER_UID, OTHER_UID)
        with pytest.raises(DirectoryNotPrivate, match=r"is a symbolic link owned by .* \(uid 65534\)"):
            check_private_directory(link, ROOT_ENV)
    plain_file = tmp_path / "file"
    plain_file.write_text("")
    with pytest.raises(DirectoryNotPrivate, match="is not a directory"):
        make_private_directory(plain_file, ROOT_ENV)
