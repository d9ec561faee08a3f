"""Child process of test_vmm_arena: receive chunk fds over a Unix socket, map them, hash the
backed bytes, write a marker, reply with JSON. Not a test module."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys

import torch

from kvd.memory.vmm import map_imported


def main(path: str) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    msg, fds, _, _ = socket.recv_fds(s, 1 << 16, 64)
    info = json.loads(msg.decode())
    owner, t = map_imported(list(zip(fds, info["sizes"])), 0, nbytes=info["backed"])
    for fd in fds:
        os.close(fd)  # the mapping keeps the memory alive
    digest = hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()
    t[info["write_at"] : info["write_at"] + info["n"]].fill_(info["fill"])
    torch.cuda.synchronize()
    s.sendall(json.dumps({"digest": digest, "nbytes": t.numel(), "ptr": t.data_ptr()}).encode())
    s.close()
    del t
    owner.close()


if __name__ == "__main__":
    main(sys.argv[1])
