"""Admission: slots, per-tenant and global waiting limits and fair turns across tenants (pure), then on a
running server: 429/529/503 with their headers on every generation route in each API's shape,
count_tokens and health never queued, a tenant's flood against a single request, and the OpenAI and
Anthropic SDKs reading the refusals as their typed errors and retrying after Retry-After."""
import asyncio
import concurrent.futures
import json
import time

import pytest

import mashbox
from mashbox import Admission, Rejected
from tests.harness import GENERATION_ROUTES, MODEL_ID, WAIT_S, error_of, start_server, until


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


def test_a_free_slot_does_not_let_a_newcomer_jump_the_queue():
    """Guards against a request taking a slot freed for someone already waiting."""
    async def main():
        a = Admission(slots=1)
        a.enter("a")
        waiter = a.enter("b")
        a.resize(2)               # a second slot appears (a worker restart reports more slots)
        assert waiter.done() and a.running == 2
        late = a.enter("c")
        assert late is not None and not late.done()
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


def test_rejections_map_to_each_apis_status_with_retry_after():
    """Guards against clients that cannot tell overload from a bad request, or a tenant limit called overload."""
    busy = ("Retry-After", str(mashbox.RETRY_AFTER_BUSY_S))
    e = mashbox.rejected_error(False, "queue_full")
    assert e.status == 429 and busy in e.headers
    e = mashbox.rejected_error(True, "queue_full")
    assert e.status == 529 and e.type == "overloaded_error" and busy in e.headers
    for anthropic in (False, True):
        e = mashbox.rejected_error(anthropic, "tenant_queue_full")
        assert e.status == 429 and busy in e.headers
    e = mashbox.not_ready_error(True)
    assert e.status == 529 and ("x-should-retry", "true") in e.headers
    assert any(k == "Retry-After" for k, _ in e.headers)
    e = mashbox.not_ready_error(False)
    assert e.status == 503 and any(k == "Retry-After" for k, _ in e.headers)


# ---- on a running server -------------------------------------------------------------------------

BLOCKER, WAITER, FLOOD, SINGLE = "sk-blocker-0001", "sk-waiter-0002", "sk-flood-00003", "sk-single-0004"
KEYS = {BLOCKER: "blocker", WAITER: "waiter", FLOOD: "flood", SINGLE: "single"}
DELAY_S = 0.01          # the fake worker's time per token: a held request keeps its slot


def post(server, path, body, key, **headers):
    return server.request("POST", path, body, {"x-api-key": key, **headers})


@pytest.fixture
def busy_server():
    """One slot, a tenant may have one request waiting and the server two."""
    with start_server(keys=KEYS, admission=Admission(slots=1, per_tenant=1, total=2), slots=1,
                      delay_s=DELAY_S, ctx=8192) as server:
        yield server


def test_full_queues_answer_429_or_529_on_every_generation_route(busy_server):
    """Guards against an overloaded server queueing without bound, or refusing in a shape or status the
    client's retry logic does not know (OpenAI: 429; Anthropic: 429 for a tenant, 529 when full)."""
    server = busy_server
    held = [server.hold(BLOCKER)]
    until(lambda: server.queue() == (1, 0), "the blocker to run")
    held.append(server.hold(WAITER))
    until(lambda: server.queue() == (1, 1), "the waiter to queue")
    try:
        for method, path, body, api in GENERATION_ROUTES:           # the waiter's tenant is full
            status, headers, answer = post(server, path, body, WAITER)
            assert status == 429, (path, answer)
            assert headers["retry-after"] == str(mashbox.RETRY_AFTER_BUSY_S)
            error_of(429, answer, api)
        held.append(server.hold(FLOOD))                            # the server's queue is full
        until(lambda: server.queue() == (1, 2), "the second waiter to queue")
        for method, path, body, api in GENERATION_ROUTES:
            status, headers, answer = post(server, path, body, SINGLE)
            assert status == (529 if api == "anthropic" else 429), (path, answer)
            assert headers["retry-after"] == str(mashbox.RETRY_AFTER_BUSY_S)
            error_of(status, answer, api)
        # count_tokens and health are never queued, nor refused by the queues
        status, _, answer = post(server, "/v1/messages/count_tokens",
                                 {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}, SINGLE)
        assert status == 200 and json.loads(answer)["input_tokens"] > 0
        status, _, answer = server.request("GET", "/v1/health")
        assert status == 200 and json.loads(answer)["waiting"] == 2
        assert server.queue() == (1, 2)
        rejected = server.app.metrics["admission_rejections_total"].values
        assert rejected[(("reason", "tenant_queue_full"),)] == len(GENERATION_ROUTES)
        assert rejected[(("reason", "queue_full"),)] == len(GENERATION_ROUTES)
    finally:
        for sock in held:
            sock.close()
    until(lambda: server.queue() == (0, 0), "the slot and queue to empty after the clients left")


def test_count_tokens_bursts_are_answered_while_every_slot_and_place_is_taken(busy_server):
    """Guards against Claude Code's bursts of count_tokens (26 in a second) waiting behind generation."""
    server = busy_server
    held = [server.hold(BLOCKER)]
    until(lambda: server.queue() == (1, 0), "the blocker to run")
    held += [server.hold(WAITER), server.hold(FLOOD)]
    until(lambda: server.queue() == (1, 2), "the queue to fill")
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "count me"}], "tools": []}
    t0 = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(26) as pool:
            answers = list(pool.map(lambda _: post(server, "/v1/messages/count_tokens?beta=true", body,
                                                   SINGLE), range(26)))
        assert [a[0] for a in answers] == [200] * 26
        assert time.monotonic() - t0 < 10   # generous for a loaded machine; queued, they would wait ~20 s
    finally:
        for sock in held:
            sock.close()


@pytest.mark.parametrize("method, path, body, api", GENERATION_ROUTES + (
    ("POST", "/v1/messages/count_tokens", {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]},
     "anthropic"),), ids=[r[1] for r in GENERATION_ROUTES] + ["/v1/messages/count_tokens"])
def test_loading_answers_503_or_529_with_retry_headers(method, path, body, api, loading_server):
    """Guards against clients giving up (or hammering) while the model loads: 503 + Retry-After for
    OpenAI, 529 + Retry-After + x-should-retry for Anthropic."""
    status, headers, answer = loading_server.request(method, path, body)
    assert status == (529 if api == "anthropic" else 503), answer
    assert headers["retry-after"] == str(mashbox.RETRY_AFTER_LOADING_S)
    assert headers.get("x-should-retry") == ("true" if api == "anthropic" else None)
    error_of(status, answer, api)


@pytest.fixture(scope="module")
def loading_server():
    with start_server(loading=True) as server:
        yield server


def test_a_tenants_flood_is_capped_and_cannot_starve_another_tenant():
    """Guards against one tenant's 40 requests filling the queue past its 32, or a second tenant's single
    request waiting until the whole flood has drained."""
    with start_server(keys=KEYS, slots=2, delay_s=DELAY_S, ctx=8192) as server:
        blockers = [server.hold(BLOCKER), server.hold(BLOCKER)]
        until(lambda: server.queue() == (2, 0), "the blockers to take both slots")
        finished: list[str] = []

        def ask(who: str, key: str, i: int):
            body = {"model": MODEL_ID, "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"echo: {who} {i}"}]}
            status, _, answer = post(server, "/v1/chat/completions", body, key)
            if status == 200:
                finished.append(who)
                assert json.loads(answer)["choices"][0]["message"]["content"] == f"{who} {i}"
            return status

        with concurrent.futures.ThreadPoolExecutor(41) as pool:
            flood = [pool.submit(ask, "flood", FLOOD, i) for i in range(40)]
            until(lambda: sum(f.done() for f in flood) == 8, "the flood's extra 8 to be refused")
            refused = [f.result() for f in flood if f.done()]
            assert refused == [429] * 8 and server.queue() == (2, 32)
            single = pool.submit(ask, "single", SINGLE, 0)
            until(lambda: server.queue() == (2, 33), "the single request to queue")
            for sock in blockers:
                sock.close()
            assert single.result(WAIT_S) == 200
            served_before_single = finished.index("single")
            statuses = [f.result(WAIT_S) for f in flood]
        assert sorted(statuses) == [200] * 32 + [429] * 8
        # Turns: the flood's first waiter and the single request take the two freed slots; at most
        # the flood's requests already running can finish before it.
        assert served_before_single <= 2, finished
        assert server.queue() == (0, 0)


# ---- the SDKs --------------------------------------------------------------------------------------

def counting(server) -> list[str]:
    """The path of every request the server's guard sees (what each SDK retry looks like here)."""
    seen: list[str] = []
    guard = server.app.guard
    check = guard.check_head

    def counted(req, needs_key):
        seen.append(req.path)
        return check(req, needs_key)
    guard.check_head = counted
    return seen


def test_sdks_see_401_as_authentication_errors_without_retrying():
    """Guards against an auth failure the SDKs retry (wasting time) or report as something else."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    with start_server(keys=KEYS) as server:
        seen = counting(server)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong-key-9", max_retries=2)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        for kwargs in ({"api_key": "sk-wrong-key-9"}, {"auth_token": "sk-wrong-key-9"}):
            client = anthropic.Anthropic(base_url=server.url, max_retries=2, **kwargs)
            with pytest.raises(anthropic.AuthenticationError):
                client.messages.create(model=MODEL_ID, max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
        assert len(seen) == 4
        ok = anthropic.Anthropic(base_url=server.url, api_key=SINGLE, max_retries=0)
        assert ok.messages.create(model=MODEL_ID, max_tokens=8,
                                  messages=[{"role": "user", "content": "echo: fine"}]).content[0].text == "fine"


def test_sdks_see_429_and_529_as_their_typed_errors_and_retry_after_retry_after(busy_server):
    """Guards against overload answers the SDKs do not retry, or retry without waiting the server's time."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    server = busy_server
    wait = mashbox.RETRY_AFTER_BUSY_S
    held = [server.hold(BLOCKER)]
    until(lambda: server.queue() == (1, 0), "the blocker to run")
    held.append(server.hold(WAITER))
    until(lambda: server.queue() == (1, 1), "the waiter to queue")
    seen = counting(server)
    try:
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key=WAITER, max_retries=1)
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError):
            oa.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}])
        assert time.monotonic() - t0 >= wait and len(seen) == 2
        an = anthropic.Anthropic(base_url=server.url, api_key=WAITER, max_retries=1)
        t0 = time.monotonic()
        with pytest.raises(anthropic.RateLimitError):
            an.messages.create(model=MODEL_ID, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert time.monotonic() - t0 >= wait and len(seen) == 4
        held.append(server.hold(FLOOD))
        until(lambda: server.queue() == (1, 2), "the queue to fill")
        del seen[:]
        an = anthropic.Anthropic(base_url=server.url, api_key=SINGLE, max_retries=1)
        t0 = time.monotonic()
        with pytest.raises(anthropic.OverloadedError):
            an.messages.create(model=MODEL_ID, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert time.monotonic() - t0 >= wait and len(seen) == 2
    finally:
        for sock in held:
            sock.close()


def test_sdks_retry_while_the_model_loads(monkeypatch):
    """Guards against SDKs giving up at once on a loading server (503 / 529 with x-should-retry)."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    monkeypatch.setattr(mashbox, "RETRY_AFTER_LOADING_S", 1)   # the server reads it per answer
    with start_server(loading=True) as server:
        seen = counting(server)
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=2)
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            oa.responses.create(model=MODEL_ID, input="hi")
        assert e.value.status_code == 503 and len(seen) == 3 and time.monotonic() - t0 >= 2
        an = anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=1)
        t0 = time.monotonic()
        with pytest.raises(anthropic.OverloadedError):
            an.messages.count_tokens(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}])
        assert len(seen) == 5 and time.monotonic() - t0 >= 1
