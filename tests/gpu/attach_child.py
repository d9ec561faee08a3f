"""Child process of test_gpu_daemon: an engine that attaches a cuda daemon's arena.

Reads one JSON command per stdin line and answers one JSON line on stdout:

* ``{"op": "attach"}`` -- (re)attach; answers the tensor's size, device, region and sha256
* ``{"op": "fill", "group", "layer", "page", "value"}`` -- fill the K view of one page, synchronize
* ``{"op": "digest", "lo", "hi"}`` -- sha256 of bytes ``[lo, hi)`` as this process sees them
* ``{"op": "quit"}`` -- close the attachment (unmaps) and the client

Not a test module."""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from kvd.client import Client


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def main(address: str) -> None:
    c = Client.connect(address, name="attach-child")
    att = None
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict = {}
        if cmd["op"] == "attach":
            if att is not None:
                att.close()
            att = c.attach()
            views_on_gpu = all(kv.k.is_cuda and (kv.v is None or kv.v.is_cuda) for layers in att.views.values() for kv in layers)
            out = {"nbytes": att.tensor.numel(), "device": str(att.tensor.device), "region": att.region_id,
                   "digest": _sha(att.tensor), "views_on_gpu": views_on_gpu}
        elif cmd["op"] == "fill":
            att.views[cmd["group"]][cmd["layer"]].k[cmd["page"]].fill_(cmd["value"])
            torch.cuda.synchronize()
        elif cmd["op"] == "digest":
            out = {"digest": _sha(att.tensor[cmd["lo"] : cmd["hi"]])}
        elif cmd["op"] == "quit":
            att.close()
            c.close()
            print(json.dumps({}), flush=True)
            return
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
