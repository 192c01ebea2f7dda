"""The run directory belongs to one run: an OS lock keeps a second trainer out, and nothing is written or deleted
through a symbolic link that leaves the directory.

The lock is `flock` on `output_dir/.lock`, held by rank 0 for the whole run; the operating system releases it when
the process ends, however it ends (an exception, Ctrl-C, SIGKILL), so a crashed run never leaves the directory
locked. Every path the trainer writes or deletes in the directory (metrics.jsonl, config.json, curves.png,
checkpoint/) is taken through `RunDirectory.path`, which refuses a link whose target lies outside it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from pathlib import Path

from dllm_fast.files import refuse_link_out_of, settled_directory
from dllm_fast.train.distributed import Ranks

LOCK = ".lock"


class RunDirectoryInUse(RuntimeError):
    """Another process holds the run directory's lock."""


class RunDirectory:
    """output_dir as one run uses it; see the module docstring."""

    def __init__(self, path: str | os.PathLike, ranks: Ranks = Ranks()):
        self.root, self.ranks = Path(path), ranks
        self._lock_fd: int | None = None

    @contextlib.contextmanager
    def locked(self):
        """Hold the directory's lock (rank 0 takes it; every rank learns whether it got it) for the block."""
        error = None
        try:  # acquired inside: an interrupt right after the lock is taken must not leave it held
            if self.ranks.writer:
                try:
                    self._acquire()
                except (RunDirectoryInUse, OSError, ValueError) as failure:
                    error = failure
            failures = [e for e in self.ranks.gather(None if error is None else str(error)) if e is not None]
            if failures:
                raise error if error is not None else RunDirectoryInUse(failures[0])
            yield self
        finally:
            try:
                self._release()
            except BaseException:  # an interrupt landed in it: finish it, then let the interrupt go on
                self._release()
                raise

    def path(self, name: str) -> Path:
        """root/name, to write or delete: refused when it is a symbolic link whose target lies outside root."""
        path = self.root / name
        refuse_link_out_of(path, self.root, where="the run directory",
                           fix="Remove the link, or pick another --output-dir.")
        return path

    def expect(self, name: str, *, directory: bool) -> Path:
        """root/name as `path` gives it, refused when it exists as the wrong kind (a directory where the run writes
        a file, or a file where it keeps a directory): found before any work, not at the first write."""
        path = self.path(name)
        if path.exists() and path.is_dir() != directory:
            kind, wanted = ("a file", "directory") if directory else ("a directory", "file")
            raise ValueError(f"{path} is {kind}, where the run keeps its {name} {wanted}; move it away, or pick "
                             "another --output-dir.")
        return path

    def remove(self, name: str) -> None:
        """Delete root/name (a directory or a file) so that a crash midway leaves it whole or absent: it is renamed
        aside first. A link inside root is removed itself, never its target."""
        path = self.path(name)
        if path.is_symlink() or path.is_file():
            path.unlink()
            return
        path = settled_directory(path)  # a swap cut short by a crash leaves the old directory aside: back first
        if not path.is_dir():
            return
        aside = path.parent / f".{path.name}.discarded-{secrets.token_hex(4)}"
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)

    # -- the lock ---------------------------------------------------------------------------------------------
    def _acquire(self) -> None:
        import fcntl

        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"--output-dir {str(self.root)!r} is a file, not a directory; pick a directory "
                                     "for the run (it is created when missing).")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise OSError(f"cannot create the run directory {self.root} ({error.strerror}); pick an --output-dir "
                          "you can write to.") from None
        lock = self.path(LOCK)
        not_a_file = (f"the run directory's lock file {lock} is not a regular file; remove it (dllm_fast makes "
                      "it) or pick another --output-dir.")
        if os.path.lexists(lock) and not stat.S_ISREG(os.lstat(lock).st_mode):  # a link, FIFO, socket, device
            raise OSError(errno.EINVAL, not_a_file)
        try:  # O_NONBLOCK: a FIFO swapped in meanwhile must not block the open
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        except OSError as error:
            raise OSError(error.errno, f"cannot open the run directory's lock file {lock}: {error.strerror}") from None
        self._lock_fd = fd  # kept before flock: an interrupt right after it must still release the lock
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            self._release()
            raise OSError(errno.EINVAL, not_a_file)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            self._release()
            raise RunDirectoryInUse(
                f"{self.root} is in use by another training run (process {holder} holds {lock}); two runs in one "
                "directory would interleave their metrics and replace each other's checkpoints. Wait for it to "
                "end, or pick another --output-dir.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def _release(self) -> None:
        fd, self._lock_fd = self._lock_fd, None  # first: a second call never closes a reused descriptor
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock
