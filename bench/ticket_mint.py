"""Tickets for a burst of requests (issue 16): the decode connector's ticket server under concurrent
proxies, tickets asked for together minted in one Allocate against one Allocate each.

    .venv-vllm/bin/python bench/ticket_mint.py            # clients 1, 8, 32; 40 tickets each, 3 rounds
    .venv-vllm/bin/python bench/ticket_mint.py --quick    # clients 1, 8; 10 tickets each, 1 round

A daemon (``python -m kvd.cli serve``, ``tiny-hybrid``) in its own process; in this process the
decode connector's ticket book and its HTTP ticket server (``kvd.connectors.vllm``: what a decode
vLLM runs beside its scheduler, without the engine), and ``--clients`` client threads, each on its
own keep-alive connection as a proxy holds them. A round: every client POSTs ``--tickets`` mints in
a row (a prompt of ``--tokens`` tokens each), timed one by one; then each ticket is given back
(DELETE, not timed). The two ways take turns round by round on the same daemon and server:

* ``one call each``: every mint is its own ``allocate_recv`` (the book with ``coalesce=False``);
* ``together``: mints asked for while another mint's call is out go in the next call, together
  (``Client.allocate_recv_many``; the default).

Reported per way and client count: mint p50/p99 (the HTTP round trip the proxy waits for),
tickets/s over the round's window, and Allocate calls per ticket. Baseline: ``GET`` of an unknown
transfer on the same server and connections (an HTTP round trip that calls no daemon).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

from benchkit import BenchDaemon, cpu_model, cpu_snap, med, others_line, own_cpu, pct  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="clients 1,8; 10 tickets each; 1 round")
    ap.add_argument("--clients", default=None, help="client counts (default 1,8,32; --quick 1,8)")
    ap.add_argument("--tickets", type=int, default=None, help="mints per client per round (default 40; --quick 10)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per way and client count (default 3; --quick 1)")
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens per ticket (default: %(default)s)")
    args = ap.parse_args()
    clients = [int(x) for x in (args.clients or ("1,8" if args.quick else "1,8,32")).split(",")]
    per = args.tickets or (10 if args.quick else 40)
    rounds = args.rounds or (1 if args.quick else 3)

    from kvd.client import Client
    from kvd.connectors.vllm_ticket_book import TicketBook
    from kvd.connectors.vllm_ticket_server import serve_tickets

    cpu0, own0 = cpu_snap(), own_cpu()
    d = BenchDaemon.spawn("--backend", "local", "--layout", "tiny-hybrid", "--arena-bytes", str(8 << 30)).wait_ready()
    kv = Client.connect(d.unix, name="decode-scheduler", transport="fast")
    layout = kv.info().layout
    books = {way: TicketBook(kv, 60.0, layout.page_size, layout, coalesce=(way == "together")) for way in ("one call each", "together")}
    ports = {}
    servers = []
    for way, book in books.items():
        srv = serve_tickets(book, "127.0.0.1:0")
        servers.append(srv)
        ports[way] = srv.server_address[1]
    prompt = [(7 * k) % 1000 + 1 for k in range(args.tokens)]
    body = json.dumps({"prompt_token_ids": prompt})
    rows: dict[tuple[str, int], dict[str, list[float]]] = {}

    def round_(way: str, n: int) -> None:
        book = books[way]
        calls0, minted0 = book.stats.mint_calls, book.stats.tickets_minted
        lat: list[list[float]] = [[] for _ in range(n)]
        base: list[list[float]] = [[] for _ in range(n)]
        rids: list[list[str]] = [[] for _ in range(n)]
        start = threading.Barrier(n + 1)
        window = [float("inf"), 0.0]
        lock = threading.Lock()

        def client(i: int) -> None:
            c = http.client.HTTPConnection("127.0.0.1", ports[way], timeout=60)
            for _ in range(3):  # warm the connection
                c.request("GET", "/v1/kvd/transfers/none")
                c.getresponse().read()
            start.wait()
            t_first = time.perf_counter()
            for _ in range(per):
                t = time.perf_counter()
                c.request("POST", "/v1/kvd/tickets", body, {"Content-Type": "application/json"})
                r = c.getresponse()
                got = json.loads(r.read())
                lat[i].append(time.perf_counter() - t)
                assert r.status == 200, got
                rids[i].append(got["kvd_rid"])
            t_last = time.perf_counter()
            with lock:
                window[0], window[1] = min(window[0], t_first), max(window[1], t_last)
            for _ in range(per):  # the baseline: an HTTP round trip that calls no daemon
                t = time.perf_counter()
                c.request("GET", "/v1/kvd/transfers/none")
                c.getresponse().read()
                base[i].append(time.perf_counter() - t)
            for rid in rids[i]:
                c.request("DELETE", f"/v1/kvd/tickets/{rid}")
                c.getresponse().read()
            c.close()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for th in threads:
            th.start()
        start.wait()
        for th in threads:
            th.join()
        row = rows.setdefault((way, n), {"lat": [], "base": [], "rate": [], "calls": []})
        row["lat"] += [x for xs in lat for x in xs]
        row["base"] += [x for xs in base for x in xs]
        minted = book.stats.tickets_minted - minted0
        row["rate"].append(minted / (window[1] - window[0]))
        row["calls"].append((book.stats.mint_calls - calls0) / minted)
        assert kv.stats().pool.requests_live == 0, "tickets left behind"

    try:
        for n in clients:
            round_("together", n)  # warm-up, not counted
            rows.pop(("together", n))
            for k in range(rounds):
                for way in (list(books) if k % 2 == 0 else list(books)[::-1]):  # taking turns, each first in turn
                    round_(way, n)
    finally:
        for srv in servers:
            srv.close()
        for book in books.values():
            book.close()
        kv.close()
        d.stop()
    print(f"ticket mints through the decode connector's ticket server -- {cpu_model()}; "
          f"tiny-hybrid, {args.tokens}-token prompts, {per} mints per client per round, {rounds} round(s), backend local")
    print("| clients | way            | mint p50 ms | mint p99 ms | tickets/s | Allocate calls / ticket | HTTP GET p50 ms | p50 / one call each |")
    print("|---------|----------------|-------------|-------------|-----------|-------------------------|-----------------|---------------------|")
    for n in clients:
        ref = med(rows[("one call each", n)]["lat"])
        for way in books:
            r = rows[(way, n)]
            p50 = med(r["lat"])
            print(f"| {n:7d} | {way:14s} | {p50 * 1e3:11.3f} | {pct(r['lat'], 0.99) * 1e3:11.3f} | {med(r['rate']):9,.0f} | "
                  f"{med(r['calls']):23.2f} | {med(r['base']) * 1e3:15.3f} | {p50 / ref:18.2f}x |")
    print(others_line(cpu0, own0))


if __name__ == "__main__":
    main()
