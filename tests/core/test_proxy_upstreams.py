"""``kvd proxy``'s choice of instance (pure): the fewest requests in flight, ties in turn; and its
configuration refusing what cannot work. The proxy itself runs against real vLLM servers in
tests/vllm/test_vllm_proxy.py."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp", reason="kvd proxy needs the proxy extra (aiohttp)")

from kvd.connectors.vllm_proxy import DOWN_S, Instance, ProxyConfig, Upstreams  # noqa: E402


def test_ties_go_in_turn_and_a_busy_instance_is_passed_over():
    ups = Upstreams([Instance("a"), Instance("b"), Instance("c")])
    assert [ups.pick().url for _ in range(4)] == ["a", "b", "c", "a"]
    with ups.take() as first, ups.take() as second:
        assert (first.url, second.url) == ("b", "c")
        assert [m.in_flight for m in ups.members] == [0, 1, 1]
        with ups.take() as third:
            assert third.url == "a"
            with ups.take() as fourth:  # all busy once: in turn again
                assert fourth.in_flight == 2 and fourth.url == "b"
    assert [m.in_flight for m in ups.members] == [0, 0, 0]


def test_a_request_that_fails_still_leaves_the_count():
    ups = Upstreams([Instance("a")])
    with pytest.raises(RuntimeError), ups.take():
        raise RuntimeError("upstream down")
    assert ups.members[0].in_flight == 0


def test_the_configuration_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="at least one instance"):
        Upstreams([])
    with pytest.raises(ValueError, match="2 --decode instance.s. but 1 --tickets"):
        ProxyConfig(["http://p"], ["http://d1", "http://d2"], ["http://t1"])
    with pytest.raises(ValueError, match="at least one --prefill"):
        ProxyConfig([], ["http://d"], ["http://t"])


def test_an_instance_that_refused_is_passed_over_until_its_time_is_up():
    ups = Upstreams([Instance("a"), Instance("b")])
    a, b = ups.members
    ups.down(a, now=100.0)
    assert {ups.pick(now=101.0).url for _ in range(4)} == {"b"}
    assert {ups.pick(now=100.0 + DOWN_S).url for _ in range(4)} == {"a", "b"}
    ups.down(b, now=100.0)
    assert {ups.pick(now=101.0).url for _ in range(4)} == {"a", "b"}, "all down: every one is a candidate again"


def test_a_request_tries_each_instance_once_before_any_again():
    ups = Upstreams([Instance("a"), Instance("b"), Instance("c")])
    tried: list[Instance] = []
    for _ in range(3):
        with ups.take(besides=tried) as m:
            assert m not in tried
            tried.append(m)
    assert sorted(m.url for m in tried) == ["a", "b", "c"]
    assert ups.pick(besides=tried).url in {"a", "b", "c"}  # all tried: any again
