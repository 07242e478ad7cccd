"""Files a crash never leaves half-written: atomic file writes and whole-directory swaps.

`atomic_write_bytes` replaces one file (synced temporary + `os.replace`). `staged_directory`
builds a directory's new contents in a temporary sibling and swaps it in at the end
(`renameat2(RENAME_EXCHANGE)` on Linux; two renames elsewhere), carrying over every entry
of the old directory its writer did not own: a process killed at any point leaves either
the old directory or the new one, never a mix. `pid_alive` tells stale owners (of a
temporary, or of a lock file) from live ones.

`lock_folder` makes one process the writer of a folder (a training run's RUN_DIR, an eval
command's --out_dir): `FOLDER/run.lock`, an exclusive `flock` (released by the kernel when its
process dies, so a stale lock of a dead PID is simply taken over) holding the owner's PID for the
message. It nests within a process (the recipe holds RUN_DIR while each variant holds RUN_DIR/NAME).
`locked_elsewhere` tells whether another live process holds a folder's lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import os
import secrets
import shutil
import sys
import tempfile
from typing import IO, Iterator

import jax

TMP_MARK = ".tmp-"  # temporary directories: `.{name}.tmp-{pid}-{random}` next to `name`
LOCK_FILE = "run.lock"

_held: dict[str, list] = {}  # lock path -> [fd, depth]


def write_synced(filename: str, data: bytes) -> None:
    """Writes and fsyncs one file (inside a staged directory, so it is never seen torn)."""
    with open(filename, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def current_umask() -> int:
    """The process's umask (read, not changed: /proc on Linux; elsewhere set and restored)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(filename: str | os.PathLike, mode: str = "wb", tmp: str | None = None) -> Iterator[IO]:
    """A file object whose contents land under `filename` whole or not at all: written to a temporary
    beside it, synced, then `os.replace`d when the block ends; an exception (a full disk) removes the
    temporary. `tmp`: a fixed temporary name, for a writer that owns the name (a locked folder), so that a
    killed write's partial file is overwritten by the rerun rather than left beside it; by default a fresh
    one (`mkstemp`, named `.tmp-PID-...` as `dead_temporaries` reads it, so that a report folder's sweep removes
    a killed write's). The file gets the mode a plain `open(filename, "w")` would (0666 less the umask), not
    mkstemp's private 0600: reports and exports stay readable to whom the umask allows."""
    filename = os.fspath(filename)
    if tmp is None:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(filename) or ".", prefix=f".tmp-{os.getpid()}-",
                                   suffix=os.path.basename(filename))
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with os.fdopen(fd, mode) as f:
            os.fchmod(f.fileno(), 0o666 & ~current_umask())
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, filename)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(filename: str, data: bytes) -> None:
    """Writes `data` to `filename` through a synced temporary file and os.replace: never a torn file."""
    with atomic_file(filename) as f:
        f.write(data)


def check_writable_dir(path: str | os.PathLike, what: str, *, swapped: bool = False) -> None:
    """A folder about to be created or written into: a ValueError naming `what` if it is empty, a
    file, lies under a file, or its nearest existing folder cannot be written. `swapped`: a folder
    `staged_directory` replaces (an export), whose stage is built beside it, so the folder holding it
    (that of its real path) must be writable too. Touches nothing."""
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{what} is empty")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{what}={path} is a file, not a folder")
    _check_creatable(path, os.path.abspath(path), what)
    if swapped:
        _check_creatable(path, os.path.dirname(os.path.realpath(path)), what)


def nearest_existing(path: str) -> str:
    """`path` itself if it exists, else its nearest existing ancestor (absolute)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def _check_creatable(path: str, start: str, what: str) -> None:
    """`path` can be created at `start` or below it: the nearest existing folder is writable."""
    existing = nearest_existing(start)
    if not os.path.isdir(existing):
        raise ValueError(f"{what}={path} lies under the file {existing}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{what}={path}: the folder {existing} is not writable")


def check_writable_file(path: str | os.PathLike, what: str) -> None:
    """A file about to be written or appended to: a ValueError naming `what` if the path is empty, a
    folder, an existing file that cannot be written, or lies where no file can be created (under a
    file, or the nearest existing folder not writable). Touches nothing."""
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{what} is empty")
    if os.path.isdir(path):
        raise ValueError(f"{what}={path} is a folder, not a file")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"{what}={path} exists and is not writable")
        return
    _check_creatable(path, os.path.dirname(os.path.abspath(path)), what)


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists on this machine."""
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # someone else's process
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    return True


def make_folder(path: str | os.PathLike) -> None:
    """Makes the folder `path` and its parents; a symlink to a folder not made yet (another disk) makes its target,
    where os.makedirs(path) would raise EEXIST on the link itself."""
    os.makedirs(os.path.realpath(path), exist_ok=True)


def fsync_file(path: str) -> None:
    """Makes a file written (and closed) without a sync durable, before a rename publishes it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Makes renames inside `path` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def dead_temporaries(directory: str, prefix: str) -> list[str]:
    """Paths in `directory` named `PREFIX + PID + "-..."` whose process is gone (killed before it renamed or
    removed them; every rerun has another PID, so they would pile up). This process's own are not listed."""
    dead = []
    for entry in os.listdir(directory):
        pid = entry[len(prefix):].split("-", 1)[0] if entry.startswith(prefix) else ""
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            dead.append(os.path.join(directory, entry))
    return dead


def remove_dead_temporaries(path: str) -> None:
    """Temporaries of `staged_directory(path)` whose process is gone (killed before its swap)."""
    parent, name = os.path.split(path)
    for tmp in dead_temporaries(parent, f".{name}{TMP_MARK}"):
        shutil.rmtree(tmp, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)
    return dst


def rename_exchange(a: str, b: str) -> bool:
    """Atomically swaps two existing paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), b)


@dataclasses.dataclass
class Stage:
    """A directory being built: write into `path`, list what you wrote in `written`, and name in
    `discard` the old directory's entries that are yours to drop. After the swap, `kept` lists
    the old entries carried over."""

    path: str
    written: set[str] = dataclasses.field(default_factory=set)
    discard: set[str] = dataclasses.field(default_factory=set)
    kept: list[str] = dataclasses.field(default_factory=list)


def check_replaceable_dir(path: str | os.PathLike, what: str = "the folder") -> str:
    """`path` as a real path, refused (ValueError) when a swap would pull the ground from under this
    process: an empty path (the working directory), the working directory itself or a folder above it.
    A swap replaces the folder's inode, so the process would be left working in a deleted folder."""
    raw = os.fspath(path)
    if not raw:
        raise ValueError(f"{what} is an empty path: name the folder to write")
    real = os.path.realpath(raw)
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:  # the working directory is already gone: nothing left to protect
        return real
    if os.path.commonpath([real, cwd]) == real:
        where = "is the working directory" if real == cwd else f"holds the working directory {cwd}"
        raise ValueError(f"{what}={raw!r} {where}; writing it would replace the folder you are in: "
                         "name a folder of its own")
    if real == os.path.realpath(os.path.expanduser("~")):  # other shells work there; every entry would be re-linked
        raise ValueError(f"{what}={raw!r} is your home folder; writing it would replace that folder whole: name a "
                         "folder of its own")
    return real


def mount_points_under(path: str) -> list[str]:
    """The folders under `path` (not following symlinks) on which another file system is mounted."""
    found = []
    for parent, dirs, _ in os.walk(path):
        for name in list(dirs):
            child = os.path.join(parent, name)
            if os.path.ismount(child):
                found.append(child)
                dirs.remove(name)
    return found


@contextlib.contextmanager
def staged_directory(path: str | os.PathLike) -> Iterator[Stage]:
    """Yields a Stage in a temporary sibling of `path`; on a normal exit, every entry of the old
    `path` neither written nor discarded is hard-linked (or copied) in, and the stage replaces
    `path` in one rename. On an exception the stage is deleted and `path` is untouched."""
    path = check_replaceable_dir(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{path!r} exists and is not a directory")
    mounts = mount_points_under(path) if os.path.isdir(path) else []
    if mounts:  # the swap would copy the mounted file system into the new folder, then delete it from the old one
        raise ValueError(f"{path!r} holds a mount point ({mounts[0]}): replacing the folder would copy that file "
                         "system and then empty it; write to a folder of its own")
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    remove_dead_temporaries(path)
    stage = Stage(os.path.join(parent, f".{name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"))
    os.mkdir(stage.path)
    try:
        yield stage
        if os.path.isdir(path):
            shutil.copymode(path, stage.path)
            for entry in sorted(os.listdir(path)):
                if entry in stage.written or entry in stage.discard:
                    continue
                src, dst = os.path.join(path, entry), os.path.join(stage.path, entry)
                if os.path.isdir(src) and not os.path.islink(src):
                    shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
                else:
                    _link_or_copy(src, dst)
                stage.kept.append(entry)
        fsync_dir(stage.path)
        old = _swap_in(stage.path, path)
    except BaseException:
        shutil.rmtree(stage.path, ignore_errors=True)
        raise
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _swap_in(tmp: str, path: str) -> str | None:
    """Makes directory `tmp` the directory `path`; returns where the old one now is (or None)."""
    if not os.path.lexists(path):
        os.rename(tmp, path)
        return None
    if rename_exchange(tmp, path):
        return tmp
    # No atomic exchange: two renames; in between, the old directory is whole under `old`.
    old = tmp + ".old"
    os.rename(path, old)
    os.rename(tmp, path)
    return old


@contextlib.contextmanager
def lock_folder(folder: str, what: str, flag: str, error: type[Exception] = ValueError) -> Iterator[None]:
    """Holds FOLDER/run.lock (creating FOLDER) or raises `error` naming the PID that holds it (the folder
    called `what`, chosen by `flag`). Only process 0 of a multi-host run locks (the others share its folder)."""
    make_folder(folder)
    path = os.path.realpath(os.path.join(folder, LOCK_FILE))
    if jax.process_index() != 0:
        yield
        return
    if path in _held:
        _held[path][1] += 1
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            with open(path, "rb") as f:  # another program's lock may hold anything: not a decode error
                owner = f.read(32).decode(errors="replace").strip() or "?"
            raise error(f"{what} {folder} in use by PID {owner} (lock {path}); wait for that run, "
                        f"or stop it, or choose another {flag}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _held[path] = [fd, 1]
    try:
        yield
    finally:
        _held[path][1] -= 1
        if not _held[path][1]:
            fd, _ = _held.pop(path)
            os.close(fd)  # releases the flock; the file stays (unlinking it would race a waiting locker)


def locked_elsewhere(lock: str) -> int | None:
    """The PID recorded in `lock` (0 if none) when another process holds its flock, else None. Probed with a
    shared lock taken and dropped at once; this process's own locks are known without a probe."""
    if os.path.realpath(lock) in _held:
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        text = os.read(fd, 32).decode(errors="replace").strip()
        return int(text) if text.isdigit() else 0
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
