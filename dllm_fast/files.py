"""Atomic writes: a reader sees the old file (or directory) or the complete new one, never a partial write.

Every write of dllm_fast goes through here (or through the trainer's run directory, which applies the same rule):
a path that is a symbolic link whose target lies outside the directory it is written in is refused, so a user's
files elsewhere are never replaced through a link (a link within the directory is followed); and a disk that
fills up midway is reported as such, naming the path, with the old file or directory left as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import glob
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside `path`; on success, fsync it and rename it over `path`.

    On an exception the temporary file is removed and `path` is left as it was.
    """
    path = Path(os.path.abspath(path))
    refuse_link_out_of(path, path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = os.path.lexists(path)
    tmp = _new_temporary_file(path)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        full = disk_full(error, path.parent)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if full:
            raise disk_full_error(path, error, previous=previous) from error
        raise


def refuse_link_out_of(path: Path, root: Path, *, where: str = "the directory it is written in",
                       fix: str = "Write to the link's target itself if you mean to replace it, or remove the "
                                  "link.") -> None:
    """Raise ValueError when `path` is a symbolic link whose target lies outside `root` (dllm_fast never writes or
    deletes through such a link: a user's files elsewhere would be replaced); a link within `root` is fine."""
    if not path.is_symlink():
        return
    target, inside = path.resolve(), root.resolve()
    if target != inside and inside not in target.parents:
        raise ValueError(f"{path} is a symbolic link to {target}, outside {where} {root}; dllm_fast never writes "
                         f"or deletes through such a link. {fix}")


def disk_full(error: BaseException, directory: Path) -> bool:
    """Whether a write into `directory` failed with `error` for want of space (or quota): an OSError saying so, a
    library's wrapped one (safetensors: "I/O error: No space left on device (os error 28)"), or any error while
    less than 1 MiB is left there (torch.save reports a full disk as "unexpected pos ..."). Call it before
    removing the partial write."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(error, Exception):  # an interrupt is an interrupt
        return False
    if any(sign in str(error) for sign in ("No space left on device", "Disk quota exceeded", "(os error 28)",
                                           "(os error 122)")):
        return True
    try:
        return shutil.disk_usage(_existing_ancestor(directory)).free < 2**20
    except OSError:
        return False


def disk_full_error(path: Path, error: BaseException, *, previous: bool | None = None) -> OSError:
    """The error to raise for a write of `path` that ran out of space: it names the path, the cause, what is left
    (`previous`: whether a `path` existed before the write, None when unknown) and the fix."""
    try:
        free = f"{shutil.disk_usage(_existing_ancestor(path)).free / 2**20:.0f} MiB free now"
    except OSError:
        free = "free space unknown"
    left = {True: f"Nothing was replaced: the previous {path.name} is intact.",
            False: f"Nothing was written: there was no {path.name} before, and none is left half-written.",
            None: f"Nothing was replaced: the previous {path.name}, if any, is intact."}[previous]
    return OSError(errno.ENOSPC, f"cannot write {path}: the disk is full ({free}; {type(error).__name__}: "
                                 f"{str(error)[:200]}). {left} Free space on that disk, or write somewhere else.")


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _new_temporary_file(path: Path) -> Path:
    """An empty file beside `path` with the permissions a plain open() would give (the umask applies; an existing
    file's mode is kept), not mkstemp's 0600, which would hide checkpoints from the rest of a group."""
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        if path.is_file():
            shutil.copymode(path, tmp)
        return tmp


def follow_umask(path: str | os.PathLike) -> None:
    """Give a file the permissions a plain open() would (0666 less the umask): libraries that write through a
    private temporary file (safetensors' save_file) leave 0600, which hides weights from the rest of a group."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    try:  # Linux reports it without changing it
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


# Siblings of a directory being written by atomic_directory: ".<name>.staging-<random>" while it is filled,
# ".<name>.replaced" (the old directory) during a swap without RENAME_EXCHANGE.
_STAGING = ".staging-"
_REPLACED = ".replaced"


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, keep_old: Callable[[str], bool] | None = None) -> Iterator[Path]:
    """Replace the directory `path` as a whole: yield an empty staging directory beside it to fill; when the
    block succeeds, the staging directory becomes `path` in one step. A crash at any point leaves either the
    old complete directory or the new complete one (find it with `settled_directory`), never a mix.

        with atomic_directory("run/checkpoint") as staging:
            torch.save(optimizer.state_dict(), staging / "optimizer.pt")
            ...

    - Before the swap every file and directory inside is fsynced; after it, the parent.
    - The swap is one renameat2(RENAME_EXCHANGE) on Linux. Where the system or filesystem lacks it, the old
      directory is renamed aside to ".<name>.replaced", then the staging directory to `path`: a crash between
      the two renames leaves `path` missing, and `settled_directory(path)`, which readers call first, moves
      the old directory back.
    - keep_old(name) picks top-level entries of the old directory to carry into the new one (as hard links, or
      copies where the filesystem has none) unless the block wrote an entry of that name. By default nothing
      is carried: the new directory replaces the old one entirely.
    - If the block raises, the staging directory is removed and `path` is untouched; a full disk is reported as
      such (`disk_full_error`), naming `path`.
    - `path` itself may not be a symbolic link that leaves its parent directory (`refuse_link_out_of`).
    - One writer per path at a time: the leftovers of an interrupted write (staging directories, an aside copy)
      are removed when the next write of the same path starts, so a concurrent writer would lose its work.
    """
    given = Path(os.path.abspath(path))
    refuse_link_out_of(given, given.parent)
    target = _absolute(path)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} exists and is not a directory; choose a directory path or move the file.")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(target)
    previous = target.is_dir()
    staging = _new_staging_directory(target)
    try:
        yield staging
        if keep_old is not None and target.is_dir():
            _carry_entries(target, staging, keep_old)
        _fsync_tree(staging)
        _swap_into_place(staging, target)
    except BaseException as error:
        full = disk_full(error, target.parent)
        if staging.exists():  # after an exchange, the staging name holds the old directory: removed either way
            _remove_tree(staging)
        if full:
            raise disk_full_error(target, error, previous=previous) from error
        raise


def settled_directory(path: str | os.PathLike) -> Path:
    """The absolute path of the complete directory at `path` written by `atomic_directory`: `path` itself,
    unless a crash in the middle of a swap without RENAME_EXCHANGE left `path` missing; then the old directory,
    renamed aside, is renamed back (or, where that is not permitted, its own path is returned)."""
    target = _absolute(path)
    replaced = _sibling(target, _REPLACED)
    if os.path.lexists(target) or not replaced.is_dir():
        return target
    try:
        _rename(replaced, target)
    except OSError:
        return target if target.is_dir() else replaced  # another reader settled it, or a read-only parent
    _fsync_directory(target.parent)
    return target


def _absolute(path: str | os.PathLike) -> Path:
    target = Path(os.path.realpath(path))
    if not target.name:
        raise ValueError(f"{str(path)!r} names no directory that can be replaced; pass a subdirectory path.")
    return target


def _sibling(target: Path, tag: str) -> Path:
    return target.parent / f".{target.name}{tag}"


def _new_staging_directory(target: Path) -> Path:
    while True:
        staging = _sibling(target, _STAGING + secrets.token_hex(4))
        try:
            staging.mkdir()  # not mkdtemp: the directory gets the usual permissions, not 0700
        except FileExistsError:
            continue
        if target.is_dir():
            shutil.copymode(target, staging)
        return staging


def _remove_leftovers(target: Path) -> None:
    settled_directory(target)
    leftovers = list(target.parent.glob(f".{glob.escape(target.name)}{_STAGING}*"))
    leftovers.append(_sibling(target, _REPLACED))
    for leftover in leftovers:
        if leftover.is_dir() and not leftover.is_symlink():
            _remove_tree(leftover)


def _carry_entries(old: Path, staging: Path, keep_old: Callable[[str], bool]) -> None:
    for entry in old.iterdir():
        destination = staging / entry.name
        if not keep_old(entry.name) or os.path.lexists(destination):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), destination)
        elif entry.is_dir():
            shutil.copytree(entry, destination, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, destination)


def _link_or_copy(source, destination):
    """A hard link (instant, no extra space; the old directory is deleted after the swap), else a copy."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
    return destination


def _swap_into_place(staging: Path, target: Path) -> None:
    if not target.exists():
        _rename(staging, target)
        _fsync_directory(target.parent)
    elif _exchange(staging, target):
        _fsync_directory(target.parent)
        _remove_tree(staging)  # the old directory, now under the staging name
    else:
        replaced = _sibling(target, _REPLACED)
        _rename(target, replaced)
        _rename(staging, target)
        _fsync_directory(target.parent)
        _remove_tree(replaced)


def _rename(source: Path, destination: Path) -> None:
    os.rename(source, destination)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # a leftover is removed by the next write of the same path


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where that is unsupported."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            file = os.path.join(directory, name)
            if not os.path.islink(file):
                with open(file, "rb") as handle:
                    os.fsync(handle.fileno())
        _fsync_directory(Path(directory))


def _fsync_directory(directory: Path) -> None:
    if os.name != "posix":  # directories cannot be opened for fsync elsewhere
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
