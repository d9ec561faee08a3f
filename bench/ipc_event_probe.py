"""What a CUDA inter-process event tells its opener when the process that recorded it dies (a
probe for issue 16's "Commit gated on the sender's copy event", not kvd code).

    python3 bench/ipc_event_probe.py            # one GPU; about 20 s

A receiver that marked a transfer READY when the sender's event fired would be fooled if the event
also fired when the sender was killed with its copies still queued. Two processes per case: the
sender queues ~2 s of GPU work (``torch.cuda._sleep``), records an interprocess event after it and
hands its IPC handle to the receiver over a pipe; the receiver opens it and polls ``query()``
every millisecond for 8 s. Cases: ``alive`` (the sender waits for the receiver's verdict: the
event must fire after ~2 s) and ``killed`` (the sender SIGKILLs itself once the receiver opened the
handle). Prints, per case, what the receiver saw: ``fired`` after how long, ``error`` (the
exception), or ``pending`` at the end; and the opener's costs (open, query).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

WORK_S = 2.0
WATCH_S = 8.0


def sender() -> None:
    import torch

    torch.cuda.init()
    # Calibrate the spin kernel: cycles per second on this GPU.
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    rate = 100_000_000 / (time.perf_counter() - t)
    ev = torch.cuda.Event(interprocess=True)
    torch.cuda._sleep(int(rate * WORK_S))
    ev.record()
    sys.stdout.write(json.dumps({"handle": ev.ipc_handle().hex(), "t": time.perf_counter()}) + "\n")
    sys.stdout.flush()
    if sys.stdin.readline().strip() == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.readline()  # alive: until the receiver's verdict is in


def receiver() -> None:
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context, before timing the open
    print("ready", flush=True)
    got = json.loads(sys.stdin.readline())
    t0 = time.perf_counter()
    ev = torch.cuda.Event.from_ipc_handle(0, bytes.fromhex(got["handle"]))
    t1 = time.perf_counter()
    ev.query()
    t2 = time.perf_counter()
    out: dict = {"open_us": (t1 - t0) * 1e6, "query_us": (t2 - t1) * 1e6}
    print("opened", flush=True)
    end = t0 + WATCH_S
    while time.perf_counter() < end:
        try:
            if ev.query():
                out["seen"] = "fired"
                break
        except RuntimeError as exc:
            out["seen"] = "error"
            out["error"] = str(exc).splitlines()[0]
            break
        time.sleep(0.001)
    else:
        out["seen"] = "pending"
    out["after_s"] = time.perf_counter() - got["t"]
    print(json.dumps(out), flush=True)


def run(case: str) -> dict:
    args = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    r = subprocess.Popen([sys.executable, __file__, "receiver"], **args)  # type: ignore[call-overload]
    assert r.stdout.readline().strip() == "ready"
    s = subprocess.Popen([sys.executable, __file__, "sender"], **args)  # type: ignore[call-overload]
    line = s.stdout.readline()
    if not line:
        return {"case": case, "seen": f"sender failed ({s.wait()})"}
    r.stdin.write(line)
    r.stdin.flush()
    assert r.stdout.readline().strip() == "opened"
    s.stdin.write("die\n" if case == "killed" else "live\n")
    s.stdin.flush()
    verdict = json.loads(r.stdout.readline())
    r.wait(timeout=30)
    if s.poll() is None:
        s.stdin.write("done\n")
        s.stdin.flush()
    verdict.update(case=case, sender_rc=s.wait(timeout=30))
    return verdict


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "sender":
        sender()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "receiver":
        receiver()
        return
    import torch

    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; work {WORK_S} s, watched {WATCH_S} s")
    for case in ("alive", "killed", "killed", "alive"):
        v = run(case)
        print(f"{case:>7}: {v.get('seen')} after {v.get('after_s', float('nan')):.3f} s (sender rc {v.get('sender_rc')}); "
              f"open {v.get('open_us', float('nan')):.0f} us, query {v.get('query_us', float('nan')):.1f} us"
              + (f"; {v['error']}" if "error" in v else ""))


if __name__ == "__main__":
    main()
