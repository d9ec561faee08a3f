"""Attach: the daemon's arena mapped into the engine's process, with per-group per-layer views
(:class:`Attachment`). A shm arena is mapped by its file path; a cuda-vmm arena's chunk fds are
fetched over the daemon's handle socket (:mod:`kvd.ipc.fdpass`) and mapped on the same GPU
(:func:`kvd.memory.vmm.import_arena`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from kvd.client.views import LayerKV, all_views
from kvd.errors import InvalidArgument, Unavailable
from kvd.pool.layout import Layout
from kvd.v1 import kvd_pb2 as pb

__all__ = ["Attachment"]


class _Owner(Protocol):
    """What keeps an attachment's memory mapped: an ``mmap`` (shm) or an
    :class:`~kvd.memory.vmm.ImportedVmm` (cuda-vmm); ``close()`` unmaps."""

    def close(self) -> None: ...


@dataclass
class Attachment:
    """The daemon's arena mapped into this process, with per-group per-layer views.

    ``views[group][layer]`` is a :class:`~kvd.client.views.LayerKV`; index its tensors with physical
    page ids. The tensors are on the CPU for a shm arena and on the arena's GPU for a cuda-vmm
    one; they cover exactly the backed bytes at attach time (attach again after finalize or
    resize). Keep the attachment alive as long as the views are used; :meth:`close` unmaps.
    Drop every view first: a GPU view used after close touches unmapped memory (a fault)."""

    layout: Layout
    region_id: str
    tensor: torch.Tensor
    views: dict[str, list[LayerKV]]
    _owner: _Owner

    def close(self) -> None:
        self.views.clear()
        self.tensor = None  # type: ignore[assignment]
        try:
            self._owner.close()
        except BufferError:
            pass  # a shm view is still referenced somewhere; the GC unmaps it later


def _attach(r: pb.AttachResponse, session: str) -> Attachment:
    layout = Layout.model_validate_json(r.layout_json)
    if r.kind == "shm":
        from kvd.memory.arena import ArenaHandle, map_shared

        mm, t = map_shared(ArenaHandle(r.kind, r.path, r.backed_bytes, r.region_id))
        return Attachment(layout, r.region_id, t, all_views(layout, t), mm)
    if r.kind == "cuda-vmm":
        return _attach_cuda(r, layout, session)
    raise InvalidArgument(f"attach: arena kind {r.kind!r} is unknown to this client; upgrade kvd")


def _attach_cuda(r: pb.AttachResponse, layout: Layout, session: str) -> Attachment:
    """Fetch the arena's chunk fds over the daemon's handle socket (with this session's id),
    map them on the same GPU, close the fds (the mapping keeps the memory alive)."""
    if not torch.cuda.is_available():
        raise Unavailable(
            f"attach: the daemon keeps its arena {r.region_id} in GPU memory (cuda-vmm), but this process has no "
            "CUDA device (torch.cuda.is_available() is false); attach from a process with CUDA on that node, or "
            "run the daemon with arena=shm"
        )
    from kvd.ipc import fdpass
    from kvd.memory.cuda import driver
    from kvd.memory.vmm import import_arena

    driver()  # Unavailable naming cuda-python, before any fd is fetched
    handles = fdpass.fetch(r.path, session=session)
    try:
        owner, t = import_arena(handles.header, handles.fds)
    finally:
        for fd in handles.fds:
            os.close(fd)
    return Attachment(layout, handles.header.region_id, t, all_views(layout, t), owner)
