"""Golden runs of the demo model through our JAX engine (llama2.c's test_all.py idea: temperature 0,
exact expected tokens, on a real small model).

The expected ids were produced once by transformers (torch, float32, CPU) on the demo folder that
engine.registry builds: the prompts rendered with the chat template from the GGUF (default system
prompt), greedy decoding. The test itself needs no torch; it drives engine.worker.Engine in-process:
    Engine(WorkerArgs(model_id, weights_folder, slots, ctx, prefill_chunks=...))
    engine.submit(Submit(rid, prompt, max_tokens, stop_ids=...)) -> [Step]   (errors come back at once)
    engine.step() -> [Step]      one round; a request's last Step has finish set
and, for the logits check, engine.model.jit_forward on the engine's own params.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine import native, registry

# <|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n
SYSTEM = [151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525, 264,
          10950, 17847, 13, 151645, 198]
USER, ASSISTANT = [151644, 872, 198], [151645, 198, 151644, 77091, 198]

FRANCE = "What is the capital of France?"
FRANCE_PROMPT = SYSTEM + USER + [3838, 374, 279, 6722, 315, 9625, 30] + ASSISTANT
# "The capital of France is Paris." then <|im_end|> (a stop id, so not among the tokens).
FRANCE_ANSWER = [785, 6722, 315, 9625, 374, 12095, 13]

PRIME = "Write a Python function is_prime(n) that checks whether n is a prime number."
PRIME_PROMPT = SYSTEM + USER + [7985, 264, 13027, 729, 374, 38217, 1445, 8, 429, 12341, 3425, 308, 374,
                                264, 10250, 1372, 13] + ASSISTANT
# 'Here\'s a Python function to check if a number is prime:\n\n```python\ndef is_prime(n):\n    """\n   '
# The smallest gap between the best and second-best logit along this answer is 0.31 (step 6), far
# above float32 noise, so any other engine computing the same model must give the same ids.
PRIME_ANSWER = [8420, 594, 264, 13027, 729, 311, 1779, 421, 264, 1372, 374, 10250, 1447, 73594, 12669,
                198, 750, 374, 38217, 1445, 982, 262, 3190, 262]

# transformers' top 5 (id, logit) for the first answer token of each prompt.
FRANCE_TOP5 = [(785, 22.62449), (49000, 18.71938), (2121, 18.68167), (59604, 17.63523), (40, 16.98338)]
PRIME_TOP5 = [(8420, 19.04163), (73594, 17.62799), (95456, 17.51222), (1249, 17.17466), (785, 16.39429)]
# Measured: our float32 forward agrees with transformers' to 1e-5 on these logits; the bound leaves
# room for another operation order or XLA version, and is still far below any real bug.
LOGIT_ATOL = 1e-3

CTX = 128                         # both prompts plus their answers fit
CHUNK = 64                        # one prefill chunk holds either prompt


def test_golden_prompts_are_the_chat_template_rendering(demo_folder):
    """The hard-coded prompt ids must be what the GGUF's own template and our tokenizer produce."""
    jinja2 = pytest.importorskip("jinja2")
    from tokenizers import Tokenizer
    folder = Path(demo_folder)
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    env = jinja2.Environment()
    env.filters["tojson"] = lambda value: json.dumps(value)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for question, prompt in ((FRANCE, FRANCE_PROMPT), (PRIME, PRIME_PROMPT)):
        text = env.from_string(template).render(messages=[{"role": "user", "content": question}],
                                                add_generation_prompt=True)
        assert tok.encode(text).ids == prompt
    assert tok.decode(FRANCE_ANSWER) == "The capital of France is Paris."


@pytest.fixture(scope="module")
def engine(demo_folder):
    worker = pytest.importorskip("engine.worker")
    # The certification gate runs at start-up, every time here (no record), with the golden answer.
    # float32 weights, whatever "auto" picks on this CPU: transformers' logits are float32 (int8 has
    # its own tests below).
    args = worker.WorkerArgs(registry.default_id(), demo_folder, slots=2, ctx=CTX, prefill_chunks=(CHUNK,),
                             certify_dir=None, golden=registry.resolve(registry.default_id()).golden,
                             dtype="float32")
    return worker.Engine(args)


def test_models_json_records_the_golden_answer():
    """The certification gate's golden check reads models.json: it must be these ids."""
    assert registry.resolve(registry.default_id()).golden == {"prompt": FRANCE_PROMPT, "answer": FRANCE_ANSWER}


def test_the_demo_passes_the_certification_gate(engine):
    """The compiled programs against the numpy reference and the golden answer, at start-up."""
    assert engine.certification == "certified", engine.certification_detail
    assert "reference forward" in engine.certification_detail
    assert "golden answer (7 tokens)" in engine.certification_detail


def run(engine, prompts: dict[str, list[int]], max_tokens: int, stop_ids: list[int]) -> dict:
    """Submit every prompt at once and step until all finish: rid -> (tokens, finish)."""
    from engine.protocol import Submit
    out = {rid: [] for rid in prompts}
    finish = {}
    for rid, prompt in prompts.items():
        for step in engine.submit(Submit(rid, prompt, max_tokens, stop_ids=stop_ids)):
            pytest.fail(f"{rid} refused: {step.error}")
    for _ in range(4 * max_tokens + 16):          # a bound, so a stuck engine fails instead of hanging
        for step in engine.step():
            out[step.rid] += step.tokens
            if step.finish is not None:
                finish[step.rid] = step.finish
        if len(finish) == len(prompts):
            return {rid: (out[rid], finish[rid]) for rid in prompts}
    pytest.fail(f"not finished after {4 * max_tokens + 16} rounds: {finish}")


def test_demo_greedy_answers_match_transformers_in_one_batch(engine, demo_folder):
    """Two requests decoded together must each give transformers' exact ids, the short one ending on
    <|im_end|> with reason stop and the long one at max_tokens with reason length."""
    stop = registry.stop_token_ids(demo_folder)
    got = run(engine, {"prime": PRIME_PROMPT, "france": FRANCE_PROMPT}, 24, stop)
    assert got["france"] == (FRANCE_ANSWER, "stop")
    assert got["prime"] == (PRIME_ANSWER, "length")


def test_demo_first_token_logits_match_transformers(engine):
    """The forward pass itself must agree with transformers on the top-5 logits, not just the argmax."""
    from engine.cache import init_cache
    from engine.model import jit_forward
    for prompt, top5 in ((FRANCE_PROMPT, FRANCE_TOP5), (PRIME_PROMPT, PRIME_TOP5)):
        # A float32 cache: this checks the forward itself (the engine's float16 cache moves these
        # logits by ~2e-3; its greedy answers are checked above).
        cache = init_cache(engine.cfg, engine.args.slots, CTX, np.float32)
        tokens = np.zeros((1, CHUNK), np.int32)
        tokens[0, :len(prompt)] = prompt
        logits, _ = jit_forward(engine.params, cache, tokens, np.zeros(1, np.int32), np.zeros(1, np.int32),
                                np.array([len(prompt)], np.int32), cfg=engine.cfg)
        logits = np.asarray(logits[0], np.float32)
        order = np.argsort(-logits)[:5]
        assert order.tolist() == [i for i, _ in top5]
        np.testing.assert_allclose(logits[order], [v for _, v in top5], atol=LOGIT_ATOL)


# ---- int8 weight-only weights (--weights-dtype int8) ------------------------------------------------

@pytest.fixture(scope="module")
def engine_int8(demo_folder):
    worker = pytest.importorskip("engine.worker")
    args = worker.WorkerArgs(registry.default_id(), demo_folder, slots=2, ctx=CTX, prefill_chunks=(CHUNK,),
                             certify_dir=None, golden=registry.resolve(registry.default_id()).golden,
                             dtype="int8")
    return worker.Engine(args)


def test_int8_demo_passes_the_certification_gate(engine_int8):
    """int8 weights against the float64 reference (the int8 tolerance) and the golden answer."""
    assert engine_int8.weights_dtype == "int8"
    assert engine_int8.certification == "certified", engine_int8.certification_detail
    assert "golden answer (7 tokens)" in engine_int8.certification_detail


def test_int8_demo_greedy_answers_match_transformers_in_one_batch(engine_int8, demo_folder):
    """int8 weights must not change the demo's greedy answers (float32 transformers' ids)."""
    stop = registry.stop_token_ids(demo_folder)
    got = run(engine_int8, {"prime": PRIME_PROMPT, "france": FRANCE_PROMPT}, 24, stop)
    assert got["france"] == (FRANCE_ANSWER, "stop")
    assert got["prime"] == (PRIME_ANSWER, "length")


def test_demo_facts_name_the_gguf_its_bits_and_what_is_held(engine, engine_int8, demo_folder):
    """/v1/models' weights, bpw and gb must tell the truth: the GGUF is what is read (6.16 bits per
    weight: mostly Q5_0 and Q8_0 blocks), and gb is what each worker holds (float32: 4 bytes per
    weight; int8: 1, plus float32 scales, norms and biases; where the int8 kernel runs, the layers'
    matrices that are wholly Q5_0 keep their 5-bit blocks, 0.69 bytes per weight, and the Q4_K and
    Q6_K down projections theirs, 0.58 and 0.82)."""
    for worker in (engine, engine_int8):
        assert worker.facts.weights == str(Path(demo_folder) / registry.DEMO_GGUF)
        assert worker.facts.bpw == 6.16
    assert 2.5 < engine.facts.gb < 2.55
    low, high = (0.51, 0.54) if native.available() else (0.6, 0.65)
    assert low < engine_int8.facts.gb < high


def test_a_prompt_reads_into_the_same_cache_in_any_chunks(engine_int8):
    """Guards products.kernel_takes and the kernel's attention (one summation order per token,
    engine.attention): a prompt's keys, values and last logits are the same bits whether it is read
    whole, in chunks of 64, 32 or 16, split unevenly (a prefix from the cache, then the rest), or
    its last tokens written one by one as decode steps write them: a cached prompt is a cold one,
    and so is a conversation's earlier answer."""
    import jax
    from engine import products
    from engine.cache import init_cache
    from engine.model import jit_forward
    if not engine_int8.cfg.native or products.widened_kinds(engine_int8.params):
        pytest.skip("the kernel takes only short chunks of some of the demo's weights on this CPU "
                    "(products.kernel_takes)")
    tokens = np.random.default_rng(3).integers(0, 20_000, (1, 256)).astype(np.int32)
    read = {}
    for chunks in ((256,), (64,) * 4, (32,) * 8, (16,) * 16, (100, 156), (240,) + (1,) * 16):
        cache = init_cache(engine_int8.cfg, 1, 256, engine_int8.kv_dtype)
        at = 0
        for n in chunks:
            logits, cache = jit_forward(engine_int8.params, cache, tokens[:, at:at + n], np.zeros(1, np.int32),
                                        np.full(1, at, np.int32), np.full(1, n, np.int32), cfg=engine_int8.cfg)
            at += n
        read[chunks] = [np.asarray(a) for a in [logits, *jax.tree.leaves(cache)]]
    whole = read.pop((256,))
    for chunks, arrays in read.items():
        for got, want in zip(arrays, whole):
            np.testing.assert_array_equal(got, want, err_msg=f"chunks {chunks}")


def test_the_log_says_whether_the_same_request_gets_the_same_answer(engine, engine_int8):
    """Guards the start-up's same-answer line (Worker._same_answer_fact): guaranteed where every
    path is row-exact and chunk-exact (int8 weights through the kernel, which takes every prefill
    chunk), not where float32 weights' products depend on the rows beside them, with that reason."""
    from engine import products
    assert engine.facts.same_answer.startswith("not guaranteed: float32 weights' products are not the same")
    if not engine_int8.cfg.native:
        assert "the native kernel does not serve this model" in engine_int8.facts.same_answer
    elif products.PREFILL_BY_KERNEL:
        assert engine_int8.facts.same_answer.startswith("guaranteed: a row's numbers are the same")
        assert "the same cache in any of the server's chunks, cold or cached" in engine_int8.facts.same_answer
    else:
        assert "widened for XLA's dot on this CPU" in engine_int8.facts.same_answer
