"""Files that survive a crash or a full disk mid-write, and one writer per folder. Standard library only.

`atomic_write_text` writes a temporary file beside the target and renames it over the target: a
reader sees the old file or the new one, never a truncated one. `staging` and `publish` do the same for
a set of files (the comparison's summary, plots and metrics): every file is written into a temporary
folder beside the targets first, and only when all of them are complete are they renamed into place,
with the signals that stop a runner held off for those renames; a failure before that leaves the
previous set untouched.
`DirectoryLock` holds an `flock` on a lock file (with the owner's process id in it, for the message)
for as long as a runner works in a folder: the kernel drops it when the owner dies, however it dies,
so a stale lock is taken over atomically; a second runner is refused with a message naming the owner.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write_text", "staging", "publish", "disk_error", "DirectoryLock", "LockedError"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: The mode a plain `open(path, "w")` would give: `mkstemp` creates 0600, which readers of a shared
#: results folder (a web server, a teammate) cannot read.
_MODE = 0o666 & ~_umask()


def _write_temp(path: Path, write: Callable[[Path], None]) -> Path:
    """Write a temporary file beside `path` with `write(tmp)`, fsync it and give it the usual mode."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _MODE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically (same folder, `fsync`, then `os.replace`)."""
    path = Path(path)
    tmp = _write_temp(path, lambda p: p.write_text(text, encoding="utf-8"))
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


#: The signals that stop a runner: held off while a set of files is renamed into place.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def staging(folder: str | os.PathLike):
    """A temporary folder inside `folder` to write a set of files into before `publish`; removed
    with whatever is left in it (everything, after a failure) when the block ends."""
    path = Path(tempfile.mkdtemp(prefix=".staging.", dir=folder))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def publish(staged: str | os.PathLike, folder: str | os.PathLike, names: list[str]) -> list[str]:
    """Move the complete files `names` from `staged` (see `staging`) into `folder` together: each is
    synced, then all are renamed into place with the stop signals held off, so that the folder holds
    the previous set or the new one (a failure before this call leaves the previous set untouched).
    Returns `names`."""
    staged, folder = Path(staged), Path(folder)
    for name in names:
        with open(staged / name, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(staged / name, _MODE)
    # Renames in one file system need no space and take microseconds; a stop signal waits for them.
    with _signals_held():
        for name in names:
            os.replace(staged / name, folder / name)
    return names


@contextlib.contextmanager
def _signals_held():
    """Hold off SIGINT/SIGTERM/SIGHUP for the block (their handlers run in the main thread, so a
    thread mask would not do): a signal that arrives meanwhile is delivered again after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in _STOP_SIGNALS
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in arrived:
            os.kill(os.getpid(), sig)


#: errno values that mean "no room": a full disk, a quota, a file-size limit.
NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def disk_error(err: OSError, what: str, where: str | os.PathLike, *, kept: bool = True) -> str | None:
    """One line for a write that failed for lack of room, or None for any other error (`kept`: the
    write was staged, so the previous files are unchanged, and the line says so)."""
    if err.errno not in NO_SPACE:
        return None
    tail = "; the previous files there are unchanged." if kept else "."
    return f"Could not write {what} to {where}: {os.strerror(err.errno)}{tail}"


class LockedError(RuntimeError):
    """Another live process holds the folder's lock."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.EPERM  # exists, owned by someone else
    return True


class DirectoryLock:
    """`with DirectoryLock(folder, what="hf-lossscale compare"): ...` — one holder per folder."""

    NAME = ".hf_lossscale.lock"

    def __init__(self, folder: str | os.PathLike, what: str = "a runner") -> None:
        self.path = Path(folder) / self.NAME
        self.what = what
        self._fd: int | None = None

    _HELD: set[Path] = set()  # locks this process holds

    def _refuse(self, owner: int) -> LockedError:
        who = f"process {owner}" if owner else "a process that is starting"
        return LockedError(
            f"{self.path.parent} is in use by {self.what} ({who}, lock file {self.path}). "
            "Wait for it to finish, or give this one another --output_dir; remove the lock file "
            "only if that process is gone."
        )

    def __enter__(self) -> DirectoryLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = self.path.resolve()
        if key in DirectoryLock._HELD:  # a second runner in this process: refused, not re-entered
            raise LockedError(
                f"{self.path.parent} is in use by {self.what} in this process (lock file {self.path})."
            )
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _MODE)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_pid(fd)
                os.close(fd)
                raise self._refuse(owner) from None
            # Re-check under the lock: a holder that just left unlinked the file we opened, and a
            # third runner may hold a new one at the path; then ours is not the lock: try again.
            try:
                here = os.stat(self.path)
            except FileNotFoundError:
                here = None
            mine = os.fstat(fd)
            if here is None or (here.st_ino, here.st_dev) != (mine.st_ino, mine.st_dev):
                os.close(fd)
                continue
            owner = _read_pid(fd)
            if owner and owner != os.getpid() and _alive(owner):
                # A live process whose pid is in the file but holds no flock: a runner from before
                # the flock (or one on a filesystem without it). Refused: it may still be writing.
                os.close(fd)
                raise self._refuse(owner)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            os.fsync(fd)
            self._fd = fd
            DirectoryLock._HELD.add(key)
            self._key = key
            return self
        raise LockedError(f"Could not take the lock {self.path}.")

    def __exit__(self, *exc) -> None:
        DirectoryLock._HELD.discard(getattr(self, "_key", None))
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            here = os.stat(self.path)
            mine = os.fstat(fd)
            if (here.st_ino, here.st_dev) == (mine.st_ino, mine.st_dev):
                self.path.unlink()  # while still holding it: a waiter re-checks and opens a new one
        except OSError:
            pass
        finally:
            os.close(fd)


def _read_pid(fd: int) -> int:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0)
    except (OSError, ValueError):
        return 0
