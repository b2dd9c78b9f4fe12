"""shm://: checkpoints in host shared memory (tmpfs), which outlives the trainer process.

A file on /dev/shm survives a crashed or killed process and is gone when the node reboots,
so a memory checkpoint costs one memory copy to write and to read, and never touches a disk
or the network. Everything else is local disk: the same durable-write and containment rules
(`LocalBackend`), so the commit protocol (manifest last, checksums, exclusive create) is the
same as on any root.

`shm://NAME` is the folder `<shm>/statereg-<uid>/<node>/NAME`, where `<shm>` is /dev/shm,
or $STATEREG_SHM_DIR (tests point it at a temporary folder), `<uid>` is this user's, and
`<node>` names this host: $STATEREG_NODE, else the host name. Several simulated nodes on one
machine thus get one memory folder each, as real hosts do.

/dev/shm is shared by every local user, so the memory of one user's job is private to that
user: `statereg-<uid>` is created 0700, files 0600 and folders 0700 below it, and every
folder from `statereg-<uid>` down to the root is checked to be a directory (never a link)
that this user owns before anything is read, written or deleted there (`check_private`). A
folder another user made first, or a link swapped in, is refused with its owner and
$STATEREG_SHM_DIR named, before a byte moves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import stat
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from statereg import env
from statereg.backends.capabilities import StoreCapabilities
from statereg.backends.checksum import HashingWriter, WrittenFile
from statereg.backends.kernel import filesystem_type, in_memory
from statereg.backends.local import LocalBackend
from statereg.backends.mappings import MappedFile, Mappings
from statereg.errors import SpecError, StorageError
from statereg.process_state import process_wide

logger = logging.getLogger(__name__)

SHM_DIR_ENV = env.SHM_DIR
NODE_ENV = env.NODE
DEFAULT_SHM_DIR = "/dev/shm"
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")
# The folder under a root where a checkpoint retired by retention waits to have its files'
# pages written over by the next save (`SharedMemoryBackend.recycle`). Not a step name: no
# listing of checkpoints sees it.
RECYCLED = ".recycled"
# Open an existing file for writing from its start without freeing its pages (no O_TRUNC);
# readable too, to be mapped (mappings.py).
_OVERWRITE = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
# A new or emptied file, readable by this user only (LocalBackend's, with mode 0600).
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def shm_dir() -> str:
    """The shared-memory folder: $STATEREG_SHM_DIR, else /dev/shm."""
    return env.shm_dir() or DEFAULT_SHM_DIR


def node_name() -> str:
    """This node's name: $STATEREG_NODE (a simulated node), else the host name."""
    return _SAFE.sub("_", env.node() or socket.gethostname()) or "node"


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still allocate on the filesystem holding `path`."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def used_bytes(path: str) -> int:
    """Bytes held by the regular files under `path` (0 if it does not exist)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                continue
    return total


# -- a private root per user -----------------------------------------------------------------

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Shared-memory folders already checked for their filesystem (one warning each).
_FILESYSTEMS_SEEN: set[str] = set()
process_wide(__name__, "_FILESYSTEMS_SEEN", "one warning per memory folder not on tmpfs")


def private_dir() -> str:
    """This user's folder of memory roots, `<shm>/statereg-<uid>`: created 0700, and used
    only while this user owns it and it is no link (`check_private`)."""
    return os.path.join(shm_dir(), f"statereg-{os.geteuid()}")


def node_dir() -> str:
    """This node's folder of memory roots: `<shm>/statereg-<uid>/<node>`."""
    return os.path.join(private_dir(), node_name())


def _warn_if_not_memory(base: str) -> None:
    if base in _FILESYSTEMS_SEEN:
        return
    _FILESYSTEMS_SEEN.add(base)
    kind = filesystem_type(base)
    if kind is not None and kind not in ("tmpfs", "ramfs"):
        logger.warning("memory tier: %s is on a %s filesystem, not tmpfs or ramfs: memory "
                       "checkpoints there are written to a disk and outlive a reboot; point "
                       "$%s at a tmpfs (e.g. /dev/shm)", base, kind, SHM_DIR_ENV)


def _not_private(path: str, why: str) -> StorageError:
    return StorageError(
        f"memory tier: {path} {why}. statereg keeps memory checkpoints in a folder that only "
        f"this user (uid {os.geteuid()}) owns, and never reads, writes or deletes under "
        "another user's folder or through a link: another local user could read the "
        "checkpoints or redirect the job's deletions. Remove it (as its owner or root), or "
        f"point ${SHM_DIR_ENV} at a folder of your own")


def _describe_owner(info: os.stat_result) -> str:
    return f"is owned by uid {info.st_uid}, not by this user"


def check_private(root: str, create: bool) -> bool:
    """Check every directory from `<shm>/statereg-<uid>` down to `root`: each is a directory
    (no link: opened with O_NOFOLLOW, one component at a time) owned by this user, the first
    one 0700. With `create`, missing ones are made 0700. Returns whether `root` exists;
    StorageError (naming the path, its owner and $STATEREG_SHM_DIR) for anything else.

    The shared-memory folder itself must be writable by its owner only or sticky (as
    /dev/shm, 1777): there, no other user can rename or replace this user's folder, so once
    checked the chain stays this user's."""
    base = shm_dir()
    relative = os.path.relpath(root, base)
    parts = relative.split(os.sep)
    if relative.startswith("..") or not parts[0].startswith("statereg-"):
        raise StorageError(f"memory tier: {root} is not below {base}")
    uid = os.geteuid()
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if info.st_mode & 0o002 and not info.st_mode & stat.S_ISVTX:
            raise StorageError(
                f"memory tier: the shared-memory folder {base} is writable by every user "
                "without the sticky bit, so another user could replace this user's folder "
                f"in it; `chmod +t {base}` (as /dev/shm is), or point ${SHM_DIR_ENV} at "
                "another folder")
        _warn_if_not_memory(base)
        current = base
        for depth, part in enumerate(parts):
            current = os.path.join(current, part)
            try:
                child = os.open(part, _DIRECTORY, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    return False
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
                child = _open_checked(part, fd, current)
            except OSError as exc:
                raise _refused(part, fd, current, exc) from None
            os.close(fd)
            fd = child
            info = os.fstat(fd)
            if info.st_uid != uid:
                raise _not_private(current, _describe_owner(info))
            if depth == 0 and stat.S_IMODE(info.st_mode) != 0o700:
                os.fchmod(fd, 0o700)  # this user's own folder: keep it to this user
        return True
    finally:
        os.close(fd)


def _open_checked(name: str, parent: int, path: str) -> int:
    try:
        return os.open(name, _DIRECTORY, dir_fd=parent)
    except OSError as exc:
        raise _refused(name, parent, path, exc) from None


def _refused(name: str, parent: int, path: str, error: OSError) -> StorageError:
    """Why `name` in `parent` could not be opened as this user's directory."""
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return _not_private(path, f"cannot be opened ({error})")
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(name, dir_fd=parent)
        return _not_private(path, f"is a symbolic link (to {target}, made by uid "
                                  f"{info.st_uid})")
    if not stat.S_ISDIR(info.st_mode):
        return _not_private(path, f"is not a directory (owned by uid {info.st_uid})")
    if info.st_uid != os.geteuid():
        return _not_private(path, _describe_owner(info))
    return _not_private(path, f"cannot be opened ({error})")


class SharedMemoryBackend(LocalBackend):
    """Checkpoints in this node's shared memory (`shm://NAME`)."""

    schemes = ("shm",)
    # The node's memory: how to use it (no broadcast reads, no zip CRC-32s, one component
    # at a time, its files written at once) is engine/io_policy.py's.
    kind = StoreCapabilities("node-memory", "memory")
    # Whether a retired checkpoint's pages are written over by the next save instead of
    # being freed and allocated again (`remove_tree`); the memory tier opens its folder with
    # `recycle=True`.
    recycle = False

    def __init__(self, url: str, options: dict[str, Any] | None = None, *,
                 recycle: bool = False) -> None:
        super().__init__(url, options)
        self.recycle = recycle
        # The mappings this process writes recycled files through (mappings.py).
        self._mappings = Mappings()
        # Whether every folder down to the root exists and is this user's (`check_private`):
        # checked now (a folder of another user is refused at once), and before each
        # operation until the whole chain exists.
        self._private = check_private(self.root, create=False)

    @classmethod
    def capabilities_at(cls, url: str) -> StoreCapabilities:
        """Node memory (the folder's filesystem is known once the root is: `capabilities`)."""
        return cls.kind

    @property
    def capabilities(self) -> StoreCapabilities:
        """Node memory; with a page cache to go around where $STATEREG_SHM_DIR is no tmpfs
        (a disk: warned about, and written as a local disk would be)."""
        return self.kind if in_memory(self.root) else replace(self.kind, page_cache=True)

    def make_private(self) -> None:
        """Create the root (each missing folder 0700) and check the chain down to it."""
        self._private = check_private(self.root, create=True)

    def _checked(self, create: bool = False) -> None:
        """Check the folders down to the root before an operation (once they all exist, they
        stay this user's: no other user can change a folder inside a 0700 folder of theirs,
        nor rename it out of a sticky shared-memory folder)."""
        if not self._private:
            self._private = check_private(self.root, create)

    # -- every operation checks the chain first -----------------------------------------

    def open_write(self, path: str, on_done: Any = None) -> Any:
        self._checked(create=True)
        self._makedirs_private(os.path.dirname(self.full_path(path)))
        return super().open_write(path, on_done)

    def _store_if_absent(self, path: str, data: bytes) -> Any:
        self._checked(create=True)
        return super()._store_if_absent(path, data)

    def makedirs(self, path: str) -> None:
        self._checked(create=True)
        self._refuse_links("mkdir", path, include_last=True)
        self._makedirs_private(self.full_path(path))
        super().makedirs(path)

    def _makedirs_private(self, full: str) -> None:
        """Make the folders of `full` below the root, each 0700."""
        missing = []
        while full != self.root and not os.path.isdir(full):
            missing.append(full)
            full = os.path.dirname(full)
        for folder in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o700)

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        self._checked()
        return super().read_bytes(path, limit)

    def open_blocks(self, path: str) -> Any:
        self._checked()
        return super().open_blocks(path)

    def open_read(self, path: str, size: int | None = None) -> Any:
        self._checked()
        return super().open_read(path, size)

    def open_ranges(self, path: str, ranges: Any, size: int | None = None) -> Any:
        self._checked()
        return super().open_ranges(path, ranges, size)

    def exists(self, path: str) -> bool:
        self._checked()
        return super().exists(path)

    def size(self, path: str) -> int:
        self._checked()
        return super().size(path)

    def list_dir(self, path: str = "") -> list[str]:
        self._checked()
        return super().list_dir(path)

    def walk(self, path: str = "") -> Any:
        self._checked()
        return super().walk(path)

    def remove_file(self, path: str) -> None:
        self._checked()
        super().remove_file(path)

    def _open_filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        name = url[len("shm://"):].strip("/")
        if not name or any(part in ("", ".", "..") for part in name.split("/")):
            raise SpecError(f"shared-memory url {url!r}: write shm://NAME, e.g. shm://run7; "
                            "NAME may not be empty nor hold '.' or '..' parts")
        base = shm_dir()
        if not os.path.isdir(base):
            raise StorageError(f"{url}: the shared-memory folder {base} does not exist; "
                               f"mount a tmpfs there or point ${SHM_DIR_ENV} at one")
        fs, _ = super()._open_filesystem("/", {})
        return fs, os.path.join(node_dir(), name)

    # -- reusing the pages of retired checkpoints ----------------------------------------

    def remove_tree(self, path: str) -> None:
        """Delete `path`; with `recycle`, a checkpoint directory at the top of the root is
        instead moved whole (one rename: it vanishes at once) to `.recycled/`, replacing what
        an earlier retirement left there, and the next save writes its files over those.

        Why: a fresh tmpfs file costs a page allocation and zeroing for every 4 KiB, and
        deleting one costs freeing them: writing 0.5 GB into new files ran at 2.5 GB/s here,
        over the pages of an existing file at 6.9 GB/s, and the unlink took 0.08 s. A file
        is taken from `.recycled/` only by a save writing the same path below its step, and
        the folder never holds more than one retired checkpoint, so the memory a tier holds
        stays within the keep_last + 1 checkpoints it is checked for at construction.
        """
        self._checked()
        full = self.full_path(path)
        if not self.recycle or not path or "/" in path or path == RECYCLED:
            super().remove_tree(path)
            return
        self._refuse_links("delete", path)
        with self._storage_op("delete", path):
            try:
                if not stat.S_ISDIR(os.lstat(full).st_mode):
                    os.unlink(full)
                    return
            except FileNotFoundError:
                return
            self.drop_recycled()
            os.makedirs(self.full_path(RECYCLED))
            os.rename(full, self.full_path(f"{RECYCLED}/{path}"))

    def drop_recycled(self) -> None:
        """Free the pages of the retired checkpoint waiting in `.recycled/`, if any."""
        self._checked()
        shutil.rmtree(self.full_path(RECYCLED), ignore_errors=True)
        self._mappings.drop_deleted()

    def release_mappings(self) -> None:
        """Drop the mappings this process kept to write recycled files (mappings.py): the
        tier is closing, and a mapping would keep a deleted file's pages."""
        self._mappings.release()

    def _mapped_writer(self, path: str, fd: int,
                       on_done: Callable[[WrittenFile], None] | None) -> HashingWriter | None:
        """With `recycle`, a file written over (not a new, empty one) is written through a
        mapping kept from one save to the next (mappings.py)."""
        if not self.recycle:
            return None
        try:
            mapping = self._mappings.take(fd)
        except (OSError, ValueError) as exc:  # no address space for it: write() still works
            logger.debug("memory tier: %s is written without a mapping (%s)",
                         self.display(path), exc)
            return None
        if mapping is None:
            return None
        sink = MappedFile(fd, mapping, self._mappings,
                          lambda: self._storage_op("write", path))
        return HashingWriter(path, sink, sink.finish, on_done)  # type: ignore[arg-type]

    def open_contained(self, path: str) -> int:
        """A read-only descriptor of the regular file at `path` below the root, opened
        without following any link (what a peer server sends); FileNotFoundError if absent,
        CorruptCheckpointError or StorageError for a link or a special file."""
        self._checked()
        return self._open_contained("read", path)

    def _open_for_write(self, path: str, full: str) -> int:
        """With `recycle`, a file of the retired checkpoint at the same path below its step
        is renamed to `full` and written over from its start (its old bytes past the new
        end are cut off when the file is closed); otherwise a new file."""
        if self.recycle:
            _, _, below = path.partition("/")
            retired = self.full_path(RECYCLED)
            try:
                names = os.listdir(retired) if below else []
            except FileNotFoundError:
                names = []
            for name in names:
                spare = f"{retired}/{name}/{below}"
                try:
                    if not stat.S_ISREG(os.lstat(spare).st_mode):
                        continue
                    os.rename(spare, full)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                return os.open(full, _OVERWRITE)
        return os.open(full, _CREATE, 0o600)
