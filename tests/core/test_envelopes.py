"""A pool's envelopes are kept per backing (Pool.envelopes, pure core): whatever the node does --
allocate, extend, free, compact, offload, restore, finalize, resize -- the kept list equals the
envelopes built afresh from the pool, and it is a new list exactly when the backing changed."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pool_testkit as pk
from kvd.daemon.node import Node
from kvd.errors import KvdError
from kvd.records import Envelope
from kvd.pool.pool import Pool
from kvd.records import AllocSpec

OPS = ["allocate", "allocate", "extend", "free", "compact", "offload", "restore", "resize"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(post_capture=st.booleans(), ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 10**6)), max_size=30))
def test_kept_envelopes_are_the_pools_after_every_step(post_capture, ops):
    s = pk.sizings()["tiny-hybrid"]
    arena = pk.arena_for(pk.Sizing(s.layout, s.reserved, 0, s.max_tokens) if post_capture else s)
    node = Node(Pool(s.layout, arena, post_capture=post_capture))

    def env() -> list:
        return node.pool.envelopes()

    def fresh() -> list[Envelope]:
        pool, a = node.pool, node.pool.arena
        return [Envelope(k.value, a.region_id, a.base, a.backed, g.pb, g.p_min, g.p_max - 1) for k, g in pool.groups.items()]

    sid = node.open_session("e").session_id
    try:
        if post_capture:
            assert env() == fresh()
            node.finalize(sid, s.backed)
        live: list[str] = []
        off: list[str] = []
        for n, (op, x) in enumerate(ops):
            before = env()
            try:
                if op == "allocate":
                    node.allocate(sid, [AllocSpec(f"r{n}", 1 + x % 60, receive=bool(x & 1))])
                    live.append(f"r{n}")
                elif op == "extend" and live:
                    rid = live[x % len(live)]
                    node.extend(sid, [(rid, node.vectors(sid, [rid])[0].tokens + 1 + x % 9)])
                elif op == "free" and live:
                    node.free(sid, [live.pop(x % len(live))])
                elif op == "compact":
                    node.compact(sid)
                elif op == "offload" and live:
                    node.offload(sid, live[x % len(live)])
                    off.append(live.pop(x % len(live)))
                elif op == "restore" and off:
                    node.restore(sid, off[-1])
                    live.append(off.pop())
                elif op == "resize" and post_capture and not live and not off:
                    node.finalize(sid, node.pool.floor_bytes() + x % (s.reserved - node.pool.floor_bytes()), resize=True)
            except KvdError:
                pass
            now = env()
            assert now == fresh(), op
            if op != "resize":
                assert now is before, op  # built again only with the backing
    finally:
        arena.close()
