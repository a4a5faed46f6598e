"""Replicas behind an existing LLM router: vllm-router (PyPI; a Rust load balancer) in front of two
`mashbox run` processes serving the fake engine (tests/fake_worker.py).

What a router needs from a backend is what mashbox serves anyway: /health (the router's default
health check), the OpenAI and Anthropic routes, X-Session-Id. Skipped, saying so, when vllm-router
is not installed (`pip install vllm-router`, which the test extra lists).
"""
from __future__ import annotations

import http.client
import importlib.util
import json
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.fake_worker import MODEL_ID
from tests.harness import HOST, ROOT, WAIT_S, CliServer, until

ROUTER_MODULE = "vllm_router.launch_router"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm_router") is None,
                                reason="vllm-router is not installed (pip install vllm-router)")
# Long enough that every request is still waiting for its first token when a replica is killed.
SLOW_PREFILL_S = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Router:
    """vllm-router in front of `replicas`, with a routing policy; url is where clients call."""

    def __init__(self, replicas: list[CliServer], policy: str):
        self.port = _free_port()
        # its Prometheus exporter listens on a fixed port unless told: two routers would collide
        self.proc = subprocess.Popen(
            [sys.executable, "-m", ROUTER_MODULE, "--host", HOST, "--port", str(self.port),
             "--prometheus-port", str(_free_port()), "--policy", policy,
             "--worker-urls", *[r.url for r in replicas]],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        until(lambda: self._ready() or self.proc.poll() is not None, "the router to answer")
        assert self.proc.poll() is None, "".join(self.lines[-20:])
        self.url = f"http://{HOST}:{self.port}"

    def _ready(self) -> bool:
        """The router's own readiness: every replica passed its health check (/health)."""
        try:
            conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
            conn.request("GET", "/readiness")
            return conn.getresponse().status == 200
        except OSError:
            return False

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def cluster(request):
    """Two replicas and a router: request.param {"policy": the router's, "fake": FakeArgs fields,
    "args": the replicas' flags}."""
    fake, policy, args = request.param.get("fake", {}), request.param["policy"], request.param.get("args", ())
    replicas = []
    try:
        replicas = [CliServer(fake, args), CliServer(fake, args)]
        router = Router(replicas, policy)
        try:
            yield router, replicas
        finally:
            router.close()
    finally:
        for replica in replicas:
            replica.close()


def _served(replica: CliServer) -> list[str]:
    """The request log lines of a replica (one per generation request)."""
    return [line for line in replica.lines if re.search(r" (POST) /v1/\S+ \d{3} ", line)]


@pytest.mark.parametrize("cluster", [{"policy": "round_robin"}], indirect=True)
def test_the_openai_and_anthropic_sdks_work_through_the_router(cluster):
    import anthropic
    import openai
    router, replicas = cluster
    oa = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    answer = oa.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "echo: one two"}])
    assert answer.choices[0].message.content == "one two"
    stream = oa.chat.completions.create(model=MODEL_ID, stream=True,
                                        messages=[{"role": "user", "content": "echo: three four"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "three four"
    an = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=WAIT_S)
    message = an.messages.create(model=MODEL_ID, max_tokens=50,
                                 messages=[{"role": "user", "content": "echo: five six"}])
    assert message.content[0].text == "five six"
    with an.messages.stream(model=MODEL_ID, max_tokens=50,
                            messages=[{"role": "user", "content": "echo: seven"}]) as s:
        assert "".join(s.text_stream) == "seven"
    assert [m.id for m in oa.models.list().data] == [MODEL_ID]
    # round robin: both replicas answered
    assert all(_served(r) for r in replicas), [r.lines for r in replicas]


def _chat(url: str, messages: list[dict], session: str, headers: dict | None = None,
          status: int = 200) -> dict:
    conn = http.client.HTTPConnection(HOST, int(url.rsplit(":", 1)[1]), timeout=WAIT_S)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": MODEL_ID, "messages": messages}),
                 {"Content-Type": "application/json", "X-Session-Id": session, **(headers or {})})
    response = conn.getresponse()
    body = json.loads(response.read())
    assert response.status == status, body
    return body


@pytest.mark.parametrize("cluster", [{"policy": "consistent_hash"}], indirect=True)
def test_each_session_sticks_to_the_replica_that_holds_its_prefix(cluster):
    """The router's consistent_hash policy keys on X-Session-Id (the header mashbox reads for its
    prompt cache), so a session's next turn goes where its conversation is cached: the fake engine
    caches the last prompt it saw, and turn 2 finds turn 1 there. Round robin would send it to the
    other replica, where nothing of it is cached."""
    router, replicas = cluster
    sessions = {f"session-{i}": f"topic {i}: the tides of the northern sea and the ships on it " * 4
                for i in range(4)}
    for s, text in sessions.items():
        turns = [{"role": "user", "content": f"{text} echo: noted {s}"}]
        first = _chat(router.url, turns, s)
        turns += [{"role": "assistant", "content": f"noted {s}"}, {"role": "user", "content": f"echo: again {s}"}]
        second = _chat(router.url, turns, s)
        assert second["choices"][0]["message"]["content"] == f"again {s}"
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # turn 1's prompt but its last few tokens (the template renders the end of a turn anew);
        # on the other replica only the template's first tokens would match
        assert cached >= first["usage"]["prompt_tokens"] - 8, (s, cached)
    # each session in one replica's log only, both turns. A replica writes its log line after the
    # answer, and a thread reads it from the process, so wait (bounded) until all are in.
    deadline = time.monotonic() + WAIT_S
    while True:
        served = [[m.group(1) for line in _served(r) for m in [re.search(r"session=(\S+)", line)] if m]
                  for r in replicas]
        if sum(map(len, served)) >= 2 * len(sessions) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for s in sessions:
        assert sorted(len([x for x in log if x == s]) for log in served) == [0, 2], (s, served)


@pytest.mark.parametrize("cluster", [{"policy": "round_robin", "fake": {"prefill_s": SLOW_PREFILL_S}}],
                         indirect=True)
def test_killing_a_replica_loses_no_request_that_had_not_started(cluster):
    """Requests on a replica that dies before their first token are sent to the other one by the
    router, and answered; none is lost."""
    router, replicas = cluster
    results: dict[int, tuple] = {}

    def ask(i: int) -> None:
        try:
            body = _chat(router.url, [{"role": "user", "content": f"echo: answer {i}"}], f"s{i}")
            results[i] = ("ok", body["choices"][0]["message"]["content"])
        except Exception as e:                  # noqa: BLE001 - any failure is what the test reports
            results[i] = ("failed", repr(e))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    until(lambda: all(r.health().get("live_rows") for r in replicas), "requests on both replicas")
    replicas[0].close()                          # SIGKILL: no goodbye to the router
    started = time.monotonic()
    for t in threads:
        t.join(WAIT_S)
    assert results == {i: ("ok", f"answer {i}") for i in range(6)}
    assert time.monotonic() - started < WAIT_S


KEYS = ROOT / "tests" / "fixtures" / "router-keys.txt"


@pytest.mark.parametrize("cluster", [{"policy": "consistent_hash", "args": ("--api-key-file", str(KEYS))}],
                         indirect=True)
def test_keys_and_tenants_pass_through_the_router(cluster):
    """The router forwards the client's key (Authorization or x-api-key) as it came: every replica
    with the same key file checks it, and its tenant's queues and limits apply there."""
    router, _ = cluster
    ask = [{"role": "user", "content": "echo: hello"}]
    assert _chat(router.url, ask, "s1", {"Authorization": "Bearer router-key-alice"})["choices"][0][
        "message"]["content"] == "hello"
    assert _chat(router.url, ask, "s2", {"x-api-key": "router-key-bob"})["choices"][0]["message"][
        "content"] == "hello"
    assert "no API key" in _chat(router.url, ask, "s3", status=401)["error"]["message"]
    assert "wrong API key" in _chat(router.url, ask, "s4", {"x-api-key": "router-key-eve"},
                                    status=401)["error"]["message"]
