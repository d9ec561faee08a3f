"""Arenas: one contiguous byte region, reserved and backed separately.

An arena reserves ``reserved`` bytes of address space at a base address that never changes,
and backs a prefix ``[0, backed)`` of it with real memory. The pool hands out pages only inside
the backed prefix; :meth:`Arena.set_backed` grows (or shrinks) the backing in place.

    base                          backed                                reserved
     |<---------- real memory ---------->|<------ address space only ------->|
     [ sink | pages of every group ...   |  (touching this is a fault)       ]

Implementations:

* :class:`ShmArena` -- a shared-memory file (``/dev/shm`` by default, or any tmpfs directory),
  mapped at full reservation and grown by ``ftruncate``. Another process maps it by path
  (:func:`map_shared`). The embedded default; runs anywhere.
* a CUDA virtual-memory arena (reserve a VA range, map physical chunks, export fds) implements
  the same interface on GPU nodes.
"""

from __future__ import annotations

import abc
import ctypes
import errno
import fcntl
import mmap
import os
import struct
import uuid
from dataclasses import dataclass

import torch

from kvd.errors import FailedPrecondition, InvalidArgument

__all__ = ["Arena", "ArenaHandle", "ShmArena", "map_shared", "reap_stale", "is_live", "fd_is_live"]


@dataclass(frozen=True, slots=True)
class ArenaHandle:
    """What another process needs to map an arena: its kind, a path or fd name, and sizes."""

    kind: str  # "shm" (a file on tmpfs) or "cuda-vmm"
    path: str  # file to map (shm); empty for fd-passing kinds
    backed: int  # bytes the peer may map now
    region_id: str  # stable name of the region for the arena's lifetime


class Arena(abc.ABC):
    """A reserved byte region with a backed prefix. The base address never changes.

    Contract: :meth:`tensor` returns a ``uint8`` tensor over ``[0, backed)`` whose
    ``data_ptr()`` equals :attr:`base`; it stays valid until :meth:`close`, across
    :meth:`set_backed` calls that do not shrink below the bytes the caller touches.
    """

    region_id: str
    # Set by every implementation's constructor; read through the properties below.
    _reserved: int
    _backed: int
    _base: int

    @property
    def reserved(self) -> int:
        """Bytes of address space reserved; fixed for the arena's lifetime."""
        return self._reserved

    @property
    def backed(self) -> int:
        """Bytes ``[0, backed)`` backed by memory now."""
        return self._backed

    @property
    def base(self) -> int:
        """Address of byte 0 (host address for CPU arenas, device address for CUDA ones)."""
        return self._base

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    @abc.abstractmethod
    def set_backed(self, nbytes: int) -> None:
        """Back exactly ``[0, nbytes)``, in place. Shrinking releases the tail's memory."""

    @abc.abstractmethod
    def tensor(self) -> torch.Tensor:
        """A ``uint8`` view of the backed prefix; never copies."""

    @abc.abstractmethod
    def handle(self) -> ArenaHandle:
        """How another process maps this arena (only the backed prefix is exported)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the memory. Views taken from :meth:`tensor` must be dropped first."""

    def _check_size(self, nbytes: int) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise InvalidArgument(f"arena size must be an int byte count, got {nbytes!r}")
        if nbytes < 0 or nbytes > self.reserved:
            raise InvalidArgument(
                f"arena backing of {nbytes:,d} bytes is outside [0, reserved={self.reserved:,d}]; "
                "reserve more address space or ask for less"
            )


class ShmArena(Arena):
    """A shared-memory file mapped once at full reservation; backing grows by ``ftruncate``.

    The file lives in ``directory`` (a tmpfs: ``/dev/shm`` by default) and is unlinked by
    :meth:`close`. Reserving is free: the mapping covers ``reserved`` bytes of address space,
    but memory is consumed only for the backed prefix that is touched. Access past
    ``backed`` raises SIGBUS, like unmapped device memory would fault. The file's mode is
    ``mode`` whatever the umask: 0600 (this user only) by default, 0660 to let an engine of
    another user in this process's group map it.

    ``allocate``: take the backed pages from the tmpfs when backing them (``posix_fallocate``),
    not when each is first written. A tmpfs without room then fails :meth:`set_backed` with
    FailedPrecondition, nothing changed, instead of killing with SIGBUS whichever process writes
    the first page past its room -- this one, an engine, or a sender daemon writing into it. The
    daemon does (``arena_fallocate``); sparse arenas (benchmarks, tests) do not.
    """

    def __init__(
        self, reserved: int, backed: int = 0, *, directory: str = "/dev/shm", name: str | None = None, mode: int = 0o600,
        allocate: bool = False,
    ):
        if not isinstance(reserved, int) or reserved <= 0:
            raise InvalidArgument(f"arena reservation must be a positive byte count, got {reserved!r}")
        if not os.path.isdir(directory):
            raise InvalidArgument(f"arena directory {directory!r} does not exist; set arena_dir to a tmpfs directory")
        self._reserved = reserved
        self._allocate = allocate
        self.directory = directory
        self.region_id = name or f"kvd-{uuid.uuid4().hex[:12]}"
        self.path = os.path.join(directory, self.region_id)
        # Liveness: an open-file-description read lock held for the arena's lifetime. The kernel
        # drops it when this process dies (even by SIGKILL), so reap_stale() can tell a dead
        # daemon's leftover file from a live arena without trusting pids. The file is locked
        # before it has its name: a daemon starting beside this one (the same arena_dir) reaps
        # every unlocked kvd-* file, so one still being set up must already look live.
        self._fd, named = _create_locked(directory, self.path)
        try:
            if mode != 0o600:
                os.fchmod(self._fd, mode)  # not through open's mode: the umask would take the group's write bit
            # Python's mmap refuses a length beyond the file size, so size the (sparse) file to the
            # reservation for the mmap call, then cut it back to the backed prefix.
            os.ftruncate(self._fd, reserved)
            self._mm = mmap.mmap(self._fd, reserved, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.ftruncate(self._fd, 0)
            if not named:  # set up and locked: give it its name now (EEXIST: like O_EXCL)
                _link(self._fd, directory, self.region_id)
        except BaseException:
            os.close(self._fd)
            if named:
                os.unlink(self.path)
            raise
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._full = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._backed = 0
        try:
            self.set_backed(backed)
        except BaseException:
            self.close()
            raise

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def set_backed(self, nbytes: int) -> None:
        self._check_size(nbytes)
        old = self._backed
        take = self._allocate and nbytes > old
        if take:
            self._room_for(nbytes - old, nbytes)
        # On tmpfs, truncating a file frees the pages past its new end, so shrinking gives the
        # memory back; growing extends the file, its pages taken now (allocate) or when first touched.
        os.ftruncate(self._fd, nbytes)
        if take:
            try:
                os.posix_fallocate(self._fd, old, nbytes - old)
            except OSError as exc:
                os.ftruncate(self._fd, old)  # as it was (tmpfs gives back what the failed call took)
                raise self._no_room(nbytes, exc.strerror or str(exc)) from exc
        self._backed = nbytes

    def _room_for(self, more: int, nbytes: int) -> None:
        """Refuse at once a backing the filesystem has no room for (``statvfs``), before spending
        a second per GiB finding out by allocating it."""
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if more > free:
            raise self._no_room(nbytes, f"{free:,d} bytes free there, {more:,d} more needed")

    def _no_room(self, nbytes: int, why: str) -> FailedPrecondition:
        return FailedPrecondition(
            f"arena_dir {self.directory!r} cannot hold the arena's {nbytes:,d} backed bytes ({why}): give that tmpfs "
            "more room (docker run --shm-size, compose shm_size, the chart's shm.sizeLimit) or ask for a smaller "
            "arena (arena_bytes, or Finalize's bytes)"
        )

    def tensor(self) -> torch.Tensor:
        return self._full[: self._backed]

    def handle(self) -> ArenaHandle:
        return ArenaHandle(kind="shm", path=self.path, backed=self._backed, region_id=self.region_id)

    def close(self) -> None:
        if self._fd < 0:
            return
        self._full = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            # Someone still holds a view; leave the mapping to the garbage collector but free the name.
            pass
        os.close(self._fd)
        self._fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __del__(self) -> None:  # best effort: never leave a file in /dev/shm behind
        try:
            self.close()
        except Exception:
            pass


def _create_locked(directory: str, path: str) -> tuple[int, bool]:
    """A new file for ``path`` holding its liveness lock, and whether it has its name yet: an
    unnamed file in ``directory`` (``O_TMPFILE``; linked to ``path`` once set up, and gone with
    its last descriptor if this process dies first) where the filesystem and ``/proc`` allow it,
    else ``path`` itself, created and locked at once (a window of two system calls)."""
    if os.path.isdir("/proc/self/fd"):
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError:  # a filesystem without O_TMPFILE
            pass
        else:
            _ofd_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK)
            return fd, False
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        _ofd_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd, True


def _link(fd: int, directory: str, name: str) -> None:
    """Give the unnamed file ``fd`` the name ``name`` in ``directory``: linkat() following the
    /proc/self/fd link (os.link calls plain link() unless a directory fd is passed, and link()
    does not follow it)."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(f"/proc/self/fd/{fd}", name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=True)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, "an arena file of that name exists", os.path.join(directory, name)) from None
    finally:
        os.close(dfd)


# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid.
_FLOCK = "hhqqi4x"


def _ofd_lock(fd: int, cmd: int, kind: int) -> int:
    res = fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, 0, 0, 0))
    return struct.unpack(_FLOCK, res)[0]


def fd_is_live(fd: int) -> bool:
    """Whether a live process holds the arena file open as ``fd`` (its owner's liveness lock).

    Asks whether a write lock could be placed: the owner's read lock is the only thing that
    conflicts with it. F_OFD_GETLK places nothing, so concurrent probes cannot fool each other."""
    return _ofd_lock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK) != fcntl.F_UNLCK


def is_live(path: str) -> bool:
    """Whether a live process holds the arena file at ``path`` (see :func:`fd_is_live`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return fd_is_live(fd)
    finally:
        os.close(fd)


def reap_stale(directory: str, prefix: str = "kvd-") -> list[str]:
    """Remove arena files in ``directory`` whose owner died without closing them (SIGKILL,
    OOM): on tmpfs they would hold their memory until reboot. Returns the removed paths."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        if not name.startswith(prefix) or not os.path.isfile(path):
            continue
        try:
            if not is_live(path):
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue  # vanished or not ours to read: leave it
    return removed


def map_shared(handle: ArenaHandle) -> tuple[mmap.mmap, torch.Tensor]:
    """Map another process's shm arena; returns the mapping (keep it alive) and a uint8 view.

    Only ``handle.backed`` bytes are mapped: that is all the owner promises to keep backed.
    """
    if handle.kind != "shm":
        raise InvalidArgument(f"map_shared maps shm arenas only, not {handle.kind!r}")
    fd = os.open(handle.path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < handle.backed:
            raise InvalidArgument(
                f"arena file {handle.path} holds {size:,d} bytes, less than the {handle.backed:,d} announced"
            )
        mm = mmap.mmap(fd, handle.backed, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)
