"""Files that survive a crash or a full disk mid-write, and one writer per folder. Standard library only.

`atomic_write_text` writes a temporary file beside the target and renames it over the target: a
reader sees the old file or the new one, never a truncated one. `DirectoryLock` holds a lock file
with the owner's process id for as long as a runner works in a folder; a second runner is refused
with a message naming the owner, and a lock left by a dead process is taken over.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_text", "DirectoryLock", "LockedError"]


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically (same folder, `fsync`, then `os.replace`)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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

    _HELD: set[Path] = set()  # locks this process holds

    def __enter__(self) -> DirectoryLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = self.path.resolve()
        if key in DirectoryLock._HELD:  # a second runner in this process: refused, not re-entered
            raise LockedError(
                f"{self.path.parent} is in use by {self.what} in this process (lock file {self.path})."
            )
        for _ in range(2):
            # The lock file appears with its pid already in it (written beside it, then hard-linked into
            # place, which fails if it exists): a second runner never reads an empty lock file.
            fd, tmp = tempfile.mkstemp(prefix=f"{self.NAME}.", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(str(os.getpid()))
                os.link(tmp, self.path)
            except FileExistsError:
                owner = self._owner()
                if owner and _alive(owner):
                    raise LockedError(
                        f"{self.path.parent} is in use by {self.what} (process {owner}, lock file {self.path}). "
                        "Wait for it to finish, or give this one another --output_dir; remove the lock file "
                        "only if that process is gone."
                    ) from None
                self.path.unlink(missing_ok=True)  # left by a process that died: take it over
                continue
            finally:
                os.unlink(tmp)
            DirectoryLock._HELD.add(key)
            self._key = key
            return self
        raise LockedError(f"Could not take the lock {self.path}.")

    def _owner(self) -> int:
        try:
            return int(self.path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def __exit__(self, *exc) -> None:
        DirectoryLock._HELD.discard(getattr(self, "_key", None))
        try:
            if self.path.read_text().strip() == str(os.getpid()):
                self.path.unlink()
        except OSError:
            pass
