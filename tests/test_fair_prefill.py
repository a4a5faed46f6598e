"""Prompts read side by side in the engine (engine.scheduler): answers, drafting, grammars, the
hybrid prompt cache and cancellation are what they are when each prompt is read alone."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.protocol import Sampling, Submit
from engine.worker import Engine, WorkerArgs
from tests.test_tool_grammar import tiny_folder  # noqa: F401 - a fixture: its byte-level tokenizer

TINY = Path(__file__).parent / "fixtures" / "tiny"


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 300 + 3 for i in range(n)]


def take(out: dict, steps) -> list:
    """Add steps to out (rid -> {"tokens", "finish", "first"}); returns the steps."""
    for step in steps:
        r = out.setdefault(step.rid, {"tokens": [], "finish": None, "first": step})
        r["tokens"] += step.tokens
        r["finish"] = step.finish or r["finish"]
    return steps


def run(engine, *submits, out: dict | None = None) -> dict:
    """Submit, step until idle; rid -> {"tokens", "finish", "first"} (added to `out`)."""
    out = {} if out is None else out
    for s in submits:
        take(out, engine.submit(s))
    for _ in range(5000):
        if not engine.busy:
            return out
        take(out, engine.step())
    pytest.fail("the engine did not finish")


def reading_order(engine) -> list[str]:
    """Record which request each prefill chunk belongs to (engine._prefill wrapped)."""
    rids = []
    real = engine._prefill
    engine._prefill = lambda work: rids.append(work.request.rid) or real(work)
    return rids


@pytest.fixture(scope="module")
def drafting():
    """The tiny int8 model with drafting where it is exact (the native kernel), 4 slots. No prefix
    cache: a prompt read again is read as it was the first time (a cached prompt's last token runs
    in the decode program, whose logits may differ from the chunk's in the last bits)."""
    return Engine(WorkerArgs("tiny", str(TINY / "qwen3"), slots=4, ctx=512, prefill_chunks=(8, 32),
                             compile_cache=None, dtype="int8", kv_dtype="int8", prefix_cache=False))


def test_answers_of_prompts_read_side_by_side_are_their_answers_read_alone(drafting):
    """Guards against a prompt's numbers depending on the prompts read beside it (its chunks, its
    slot's cache, its sampler row), greedy or seeded, drafted or not, and a compile after ready."""
    submits = [Submit("long", prompt(1, 170), 24),
               Submit("mid", prompt(2, 90), 20, Sampling(temperature=0.8, seed=4)),
               Submit("short", prompt(3, 12), 16), Submit("rep", prompt(4, 10) * 8, 30)]
    alone = {s.rid: run(drafting, s)[s.rid]["tokens"] for s in submits}
    order = reading_order(drafting)
    together = run(drafting, *submits)
    assert {rid: r["tokens"] for rid, r in together.items()} == alone
    firsts = {rid: order.index(rid) for rid in alone}
    assert firsts["short"] < order.index("long", firsts["long"] + 1)      # read beside "long"
    assert drafting.compiles_after_ready() == 0


def test_cancelling_a_prompt_mid_read_gives_its_slot_to_the_next_request(drafting):
    """Guards against a cancelled prompt's slot held until its prompt would have ended, or its
    chunks read on after the cancel; the prompt read beside it answers as it does alone."""
    want = run(drafting, Submit("b", prompt(6, 150), 8))["b"]["tokens"]
    order = reading_order(drafting)
    for s in [Submit("a", prompt(5, 200), 8), Submit("b", prompt(6, 150), 8),
              *[Submit(f"busy{i}", prompt(10 + i, 6), 60) for i in range(2)], Submit("c", prompt(7, 20), 8)]:
        assert drafting.submit(s) == []
    out: dict = {}
    for _ in range(4):
        take(out, drafting.step())
    assert drafting.scheduler.requests["a"].prefilling and drafting.stats().waiting == 1
    read = len(order)
    assert [(s.rid, s.finish) for s in take(out, drafting.cancel("a"))] == [("a", "abort")]
    assert "c" in [s.rid for s in take(out, drafting.step()) if s.prompt_tokens]     # c has the slot
    run(drafting, out=out)
    assert "a" not in order[read:] and out["b"]["tokens"] == want and out["c"]["finish"] == "length"


def test_a_constrained_request_read_beside_long_prompts_keeps_its_grammar(grammar_engine, tiny_folder):
    """Guards against a grammar's mask applied to another prompt's first token, or lost, when the
    prompts' chunks alternate."""
    from engine import chat
    from engine.chat import Job, Message
    from tests.test_tool_grammar import PICK, SHELL, _calls
    tok = chat.Tokenizer.from_folder(tiny_folder)
    job = Job(messages=[Message("user", "hi")], tools=[PICK, SHELL], tool_choice={"name": "pick"})
    forced = tok.encode("<|im_start|>user\nWhat is the weather?<|im_end|>\n<|im_start|>assistant\n"
                        + chat.answer_prefix(job, "qwen3"))
    longs = [Submit(f"long{i}", prompt(20 + i, 120), 6) for i in range(2)]
    alone = {s.rid: run(grammar_engine, s)[s.rid]["tokens"] for s in longs}
    order = reading_order(grammar_engine)
    assert grammar_engine.submit(Submit("forced", forced, 200, stop_ids=tok.stop_ids,
                                        constraint=chat.tool_constraint(job, "qwen3"))) == []
    while not grammar_engine.grammars.settled("forced"):     # then it is read beside the others
        grammar_engine.grammars.wait(0.05)
    out = run(grammar_engine, *longs)
    calls, _ = _calls(tok, job, "qwen3", out["forced"]["tokens"])
    assert len(calls) == 1 and calls[0][0] == "pick" and out["forced"]["finish"] == "stop"
    assert {s.rid: out[s.rid]["tokens"] for s in longs} == alone
    assert order.index("forced") < max(i for i, rid in enumerate(order) if rid.startswith("long"))


def test_hybrid_conversations_read_side_by_side_reuse_their_snapshots_and_match_a_cold_run():
    """Guards against a hybrid prompt's snapshot taken in another slot or at another prompt's cut
    point while chunks alternate: the next turns, served from the snapshots, would change."""
    folder = str(TINY / "qwen3-next")
    hot = Engine(WorkerArgs("tiny-next", folder, slots=2, ctx=512, prefill_chunks=(8, 32),
                            compile_cache=None, cache_ram_mib=1))
    cold = Engine(WorkerArgs("tiny-next", folder, slots=1, ctx=512, prefill_chunks=(8, 32),
                             compile_cache=None, prefix_cache=False))
    history = {s: (prompt(s, 60 + 30 * s), [20 + s]) for s in (1, 2)}
    for turn in range(3):
        subs = {s: Submit(f"h{s}-{turn}", tokens, 5, cuts=cuts) for s, (tokens, cuts) in history.items()}
        got = run(hot, *subs.values())
        for s, (tokens, cuts) in history.items():
            mine = got[subs[s].rid]
            want = run(cold, Submit(f"c{s}-{turn}", tokens, 5, cuts=cuts))[f"c{s}-{turn}"]["tokens"]
            assert mine["tokens"] == want, f"conversation {s} turn {turn + 1}"
            if turn:
                assert mine["first"].cached_tokens >= len(tokens) - 12, (s, turn)
            new = tokens + mine["tokens"] + prompt(s + 50 + turn, 10)
            history[s] = (new, cuts + [len(tokens) + len(mine["tokens"]), len(new)])
    assert hot.compiles_after_ready() == 0


@pytest.fixture(scope="module")
def grammar_engine(tiny_folder):
    """The tiny model with a byte-level tokenizer a grammar can constrain (tests.test_tool_grammar)."""
    return Engine(WorkerArgs("tiny", tiny_folder, slots=4, ctx=512, prefill_chunks=(8, 32),
                             compile_cache=None, dtype="float32", prefix_cache=False))
