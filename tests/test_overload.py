"""Overload: 300 requests at once against a few busy slots. Exactly the server's 256 wait, the rest are
refused at once with 429 (OpenAI routes) or 529 (Anthropic) and Retry-After, no answer is lost or
mixed up, and every request that waited is answered in full."""
import asyncio
import json
import time

import mashbox
from tests.harness import HOST, MODEL_ID, WAIT_S, start_server, until

REQUESTS = 300
SLOTS = 4
TENANTS = 10            # 30 requests each: under the per-tenant 32, so the server's 256 is what binds
KEYS = {f"sk-overload-{i:04d}": f"tenant-{i}" for i in range(TENANTS)}
BLOCKER = "sk-overload-blocker"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


def body_for(path: str, word: str) -> dict:
    if path == "/v1/completions":
        return {"model": MODEL_ID, "prompt": f"echo: {word}", "max_tokens": 8}
    if path == "/v1/responses":
        return {"model": MODEL_ID, "input": f"echo: {word}", "max_output_tokens": 8}
    return {"model": MODEL_ID, "max_tokens": 8, "messages": [{"role": "user", "content": f"echo: {word}"}]}


async def ask(port: int, i: int) -> tuple[int, str, dict, bytes]:
    """One request on its own connection (Connection: close): (i, path, status+headers, body)."""
    path = ROUTES[i % len(ROUTES)]
    key = list(KEYS)[i % TENANTS]
    body = json.dumps(body_for(path, f"w{i}w")).encode()
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                 f"x-api-key: {key}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    data = await reader.read()          # until the server closes: the whole answer
    writer.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    headers["status"] = int(lines[0].split()[1])
    if headers.get("transfer-encoding") == "chunked":   # not expected: these requests do not stream
        raise AssertionError(f"request {i} answered with a stream")
    return i, path, headers, payload


def test_300_concurrent_requests_256_wait_the_rest_are_refused_and_every_waiter_is_answered():
    """Guards against an unbounded queue, refusals without Retry-After or in the wrong status, and
    answers lost or crossed between requests when hundreds wait at once."""
    with start_server(keys={**KEYS, BLOCKER: "blocker"}, slots=SLOTS, delay_s=0.005, ctx=8192) as server:
        blockers = [server.hold(BLOCKER) for _ in range(SLOTS)]
        until(lambda: server.queue() == (SLOTS, 0), "the blockers to take every slot")
        peak = 0

        async def main():
            nonlocal peak
            tasks = [asyncio.create_task(ask(server.port, i)) for i in range(REQUESTS)]
            deadline = time.monotonic() + WAIT_S
            while sum(t.done() for t in tasks) < REQUESTS - mashbox.MAX_WAITING_TOTAL:
                assert time.monotonic() < deadline, "refusals did not arrive"
                await asyncio.sleep(0.05)
                peak = max(peak, (await asyncio.to_thread(server.queue))[1])
            await asyncio.sleep(0.2)    # nothing else may be refused or admitted while the slots are held
            running, waiting = await asyncio.to_thread(server.queue)
            assert (running, waiting) == (SLOTS, mashbox.MAX_WAITING_TOTAL)
            assert sum(t.done() for t in tasks) == REQUESTS - mashbox.MAX_WAITING_TOTAL
            for sock in blockers:
                sock.close()
            return await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)

        t0 = time.monotonic()
        results = asyncio.run(main())
        elapsed = time.monotonic() - t0
        assert peak <= mashbox.MAX_WAITING_TOTAL
        assert sorted(i for i, *_ in results) == list(range(REQUESTS))      # one answer each
        refused = [(i, path, h) for i, path, h, _ in results if h["status"] != 200]
        assert len(refused) == REQUESTS - mashbox.MAX_WAITING_TOTAL
        for i, path, h in refused:
            assert h["status"] == (529 if path == "/v1/messages" else 429), (i, path, h)
            assert h["retry-after"] == str(mashbox.RETRY_AFTER_BUSY_S)
        for i, path, h, payload in results:
            if h["status"] == 200:          # each answer is its own request's text
                assert f"w{i}w" in payload.decode(), (i, path, payload[:200])
                assert f"w{i + 1}w" not in payload.decode()
        rejections = server.app.metrics["admission_rejections_total"].values
        assert rejections[(("reason", "queue_full"),)] == len(refused)
        until(lambda: server.queue() == (0, 0), "the server to be idle")
        assert elapsed < WAIT_S
