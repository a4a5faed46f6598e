"""Admission: slots, per-tenant and global waiting limits, and fair turns across tenants."""
import asyncio

import pytest

import mashbox
from mashbox import Admission, Rejected


def run(coro):
    return asyncio.run(coro)


def test_requests_take_free_slots_without_waiting():
    """Guards against queueing work when a slot is free (added latency for nothing)."""
    async def main():
        a = Admission(slots=2)
        assert a.enter("t") is None and a.enter("t") is None
        assert a.running == 2 and a.waiting == 0
        fut = a.enter("t")
        assert fut is not None and not fut.done() and a.waiting == 1
        a.release()
        assert fut.done() and a.running == 2 and a.waiting == 0
    run(main())


def test_a_tenant_past_its_limit_is_refused_and_others_still_wait():
    """Guards against one tenant filling the whole queue."""
    async def main():
        a = Admission(slots=1, per_tenant=3, total=10)
        a.enter("flood")
        for _ in range(3):
            a.enter("flood")
        with pytest.raises(Rejected) as e:
            a.enter("flood")
        assert e.value.reason == "tenant_queue_full"
        assert a.enter("other") is not None
    run(main())


def test_the_global_queue_limit_refuses_with_its_own_reason():
    """Guards against unbounded waiting across many tenants."""
    async def main():
        a = Admission(slots=1, per_tenant=5, total=4)
        a.enter("a")
        for i in range(4):
            a.enter(f"t{i}")
        with pytest.raises(Rejected) as e:
            a.enter("t9")
        assert e.value.reason == "queue_full"
    run(main())


def test_waiting_tenants_take_turns_when_slots_free():
    """Guards against first-come-first-served starving a tenant behind another's flood."""
    async def main():
        a = Admission(slots=1)
        a.enter("flood")
        flood = [a.enter("flood") for _ in range(5)]
        single = a.enter("single")
        a.release()               # first freed slot: the flood's first waiter (it queued first)
        assert flood[0].done() and not single.done()
        a.release()               # second: the other tenant's turn
        assert single.done()
        assert not flood[1].done()
    run(main())


def test_a_waiter_that_leaves_gives_up_its_place():
    """Guards against a disconnected client's place (or slot) leaking."""
    async def main():
        a = Admission(slots=1)
        a.enter("t")
        fut = a.enter("t")
        a.leave_queue("t", fut)
        assert a.waiting == 0
        fut2 = a.enter("t")
        a.release()
        assert fut2.done() and a.running == 1
        a.leave_queue("t", fut2)  # granted, then the client left before it ran: slot handed back
        assert a.running == 0
    run(main())


def test_rejections_map_to_429_on_openai_and_529_on_anthropic_with_retry_after():
    """Guards against clients that cannot tell overload from a bad request."""
    e = mashbox.rejected_error(False, "queue_full")
    assert e.status == 429 and ("Retry-After", str(mashbox.RETRY_AFTER_BUSY_S)) in e.headers
    e = mashbox.rejected_error(True, "tenant_queue_full")
    assert e.status == 529 and e.type == "overloaded_error"
    assert any(k == "Retry-After" for k, _ in e.headers)
    e = mashbox.not_ready_error(True)
    assert e.status == 529 and ("x-should-retry", "true") in e.headers
    e = mashbox.not_ready_error(False)
    assert e.status == 503 and any(k == "Retry-After" for k, _ in e.headers)
