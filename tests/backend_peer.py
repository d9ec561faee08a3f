"""The peer side of tests/test_backends.py, run as its own process.

    python tests/backend_peer.py BACKEND RESERVED BACKED

Creates a ShmArena, fills it with the pattern ``i % 251``, registers it with a backend and
prints one JSON line: ``{"endpoint", "base", "backed", "path", "region_id", "registration_seconds"}``.
Then serves one command per stdin line, one JSON reply per stdout line:

    hash OFFSET LEN   blake2b of arena bytes [OFFSET, OFFSET+LEN)   -> {"hash": "..."}
    fill              rewrite the pattern over the backed prefix      -> {"ok": true}
    grow BACKED       set_backed(BACKED) and register again           -> the start-up JSON, updated
    meta AGENT        the nixl backend's agent metadata, hex          -> {"metadata": "..."} or {"error": "..."}
    quit              close backend and arena, exit 0                 -> {"bye": true}
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvd.memory.arena import ShmArena
from kvd.backends import make_backend  # noqa: E402


def pattern(lo: int, hi: int) -> torch.Tensor:
    """Bytes ``i % 251`` for i in [lo, hi): 251 is prime, so no page-aligned block repeats it."""
    return (torch.arange(lo, hi, dtype=torch.int64) % 251).to(torch.uint8)


def main() -> None:
    name, reserved, backed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    arena = ShmArena(reserved, backed)
    backend = make_backend(name)

    def describe(seconds: float) -> str:
        return json.dumps({"endpoint": backend.endpoint, "base": arena.base, "backed": arena.backed,
                           "path": arena.path, "region_id": arena.region_id, "registration_seconds": seconds})

    arena.tensor().copy_(pattern(0, backed))
    print(describe(backend.register(arena)), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "hash":
            off, n = int(args[0]), int(args[1])
            reply = {"hash": hashlib.blake2b(arena.tensor()[off : off + n].numpy(), digest_size=16).hexdigest()}
        elif cmd == "fill":
            arena.tensor().copy_(pattern(0, arena.backed))
            reply = {"ok": True}
        elif cmd == "grow":
            old = arena.backed
            arena.set_backed(int(args[0]))
            arena.tensor()[old:].copy_(pattern(old, arena.backed))
            print(describe(backend.register(arena)), flush=True)
            continue
        elif cmd == "meta":  # what Peer.TransferMetadata answers a daemon
            try:
                reply = {"metadata": backend.metadata(args[0]).hex()}  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 -- reported to the test, which raises it
                reply = {"error": f"{type(exc).__name__}: {exc}"}
        elif cmd == "quit":
            break
        else:
            reply = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(reply), flush=True)
    backend.close()
    arena.close()
    print(json.dumps({"bye": True}), flush=True)


if __name__ == "__main__":
    main()
