"""The certification gate: do the compiled programs compute this model correctly on this chip?

Run by the worker at start-up, after the warm-up, on the device it owns (gate(engine)):
  1. reference: a float64 numpy forward of the whole model, written here from the checkpoint's own
     tensors (its Hugging Face names, no engine code), for a short fixed prompt; the compiled prefill
     program's logits at the prompt's last token but one, and the compiled decode program's at its
     last, must match it within TOLERANCE + KV_TOLERANCE (max |difference| over the vocabulary, in
     units of the reference logits' standard deviation), and agree on the top token where the
     reference is not near a tie;
  2. golden: where models.json records a golden prompt and answer, greedy decoding through the
     compiled programs must give exactly the answer's ids;
  3. routed experts: for mixture-of-experts models, the kernel path against the exact path
     (routed_experts_check below; a dense model has nothing to compare).
Passing is "certified"; a failure is "not_certified" with the reason, and the server still serves.
The result is recorded per (component_set_sha, deployment_id) under the cache root, so a later start
of the same build on the same chip reads it instead of running the gate again (unless --recertify).

The model programs run are the ones requests run (the scheduler's chunks and decode batches), so
that part compiles nothing the warm-up did not (the routed-expert check compiles its own two).
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from engine.checkpoint import Checkpoint, is_random

# Max |compiled - reference| over the vocabulary, in reference standard deviations: what the weights
# dtype may cost (TOLERANCE) plus what the KV cache's may (KV_TOLERANCE), their roundings being
# independent. float32 programs agree with the float64 reference to about 2e-6 (tiny models) to 2e-4
# (the demo); a float16 cache and bfloat16 weights and activations cost more. A wrong RoPE, bias,
# norm or mask moves the logits by a whole deviation or more. int8 weight-only weights (per-channel
# scales) round each weight to 1/254 of its row's range: the demo's prefill logits moved 0.17
# deviations (measured), so int8 gets 0.3. An int8 cache rounds each key or value to 1/254 of its
# range, and a prefill chunk over it rounds the queries and probabilities to bfloat16 where the CPU
# multiplies bfloat16 (engine.attention.WIDE_INT8_ATTENTION): with float32 weights the demo's prefill
# logits moved 0.24 deviations (measured), so an int8 cache adds 0.3; with int8 weights too 0.27
# (measured) against 0.6, still well under a bug's.
TOLERANCE = {"float32": 2e-3, "bfloat16": 1e-1, "float16": 5e-2, "int8": 3e-1}
KV_TOLERANCE = {"float32": 0.0, "bfloat16": 1e-1, "float16": 5e-2, "int8": 3e-1}
# The reference prompt: this many tokens, fixed ids spread over the vocabulary (the reference costs
# one read of the weights, whatever the length).
PROMPT_TOKENS = 8
# For tests: set to anything, the compiled logits are shifted before the comparison, as a broken
# program's would be, so the gate must fail.
CORRUPT_ENV = "MASHBOX_CERTIFY_CORRUPT"
RECORD_DIR = "certified"
# Reference lm_head rows multiplied per block (bounds the float64 copy of a large vocabulary).
VOCAB_BLOCK = 16384
# What random weights (--weights random) report: no reference or golden answer can hold for them.
RANDOM_DETAIL = "random weights, not certified"


def fixed_prompt(vocab_size: int) -> list[int]:
    return [(1 + 7919 * i) % vocab_size for i in range(PROMPT_TOKENS)]


# ---- the reference forward (numpy, float64) --------------------------------------------------------

class _Tensors(Checkpoint):
    """Tensors by their checkpoint names (engine.checkpoint); [] gives them as float64."""

    def __getitem__(self, name: str) -> np.ndarray:
        return self.get(name).astype(np.float64)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _swiglu(h, gate, up, down):
    g = h @ gate.T
    return (g / (1 + np.exp(-g)) * (h @ up.T)) @ down.T


def _experts(t: _Tensors, p: str, h, cfg):
    """Routed experts as transformers' Qwen3-MoE block computes them: softmax over the router's
    logits, the top k per token (renormalized when norm_topk_prob), each a SwiGLU, weighted and summed."""
    logits = h @ t[p + "gate.weight"].T                                    # [T, experts]
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    fused = t.has(p + "experts.gate_up_proj")
    gate_up = t[p + "experts.gate_up_proj"] if fused else None
    down = t[p + "experts.down_proj"] if fused else None
    m = cfg.moe_intermediate_size
    for n in range(h.shape[0]):
        top = np.argsort(-probs[n], kind="stable")[:cfg.experts_per_token]
        w = probs[n, top] / (probs[n, top].sum() if cfg.norm_topk_prob else 1.0)
        for e, weight in zip(top, w):
            if fused:
                g, u, d = gate_up[e, :m], gate_up[e, m:], down[e]
            else:
                q = f"{p}experts.{e}."
                g, u, d = t[q + "gate_proj.weight"], t[q + "up_proj.weight"], t[q + "down_proj.weight"]
            out[n] += weight * _swiglu(h[n:n + 1], g, u, d)[0]
    return out


def _inverse_frequencies(cfg) -> tuple[np.ndarray, float]:
    if cfg.rope_type == "default":
        return 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim), 1.0
    # YaRN's frequency ramp is a static table, not a program: the engine's numpy function is reused.
    from engine.model import rope_frequencies
    inv, scale = rope_frequencies(cfg)
    return inv.astype(np.float64), scale


def reference_logits(folder: str, cfg, tokens: list[int]) -> np.ndarray:
    """float64 logits [len(tokens), vocab] of the model in `folder` for one prompt from position 0."""
    t = _Tensors(folder)
    n, d = len(tokens), cfg.head_dim
    # the prompt's rows of the embedding only, and the head VOCAB_BLOCK rows at a time (below): never
    # a whole float32 vocabulary table (docs/perf-log.md, "The first start's peak memory")
    x = np.concatenate([t.get("model.embed_tokens.weight", slice(tok, tok + 1)) for tok in tokens]
                       ).astype(np.float64)                                  # [T, hidden]
    inv, scale = _inverse_frequencies(cfg)
    angles = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]       # [T, d/2]
    cos, sin = np.cos(angles)[:, None] * scale, np.sin(angles)[:, None] * scale
    causal = np.tril(np.ones((n, n), bool))

    def rope(v):                                                           # [T, H, d], halves layout
        a, b = v[..., : d // 2], v[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = _rms(x, t[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        proj = {}
        for name, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
            out = h @ t[p + f"self_attn.{name}_proj.weight"].T
            if t.has(p + f"self_attn.{name}_proj.bias"):
                out = out + t[p + f"self_attn.{name}_proj.bias"]
            proj[name] = out.reshape(n, heads, d)
        q, k, v = proj["q"], proj["k"], proj["v"]
        if t.has(p + "self_attn.q_norm.weight"):
            q = _rms(q, t[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
            k = _rms(k, t[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
        q, k = rope(q), rope(k)
        group = cfg.num_heads // cfg.num_kv_heads
        heads_out = []
        for head in range(cfg.num_heads):
            kv = head // group
            scores = q[:, head] @ k[:, kv].T / np.sqrt(d)                 # [T, T]
            scores = np.where(causal, scores, -np.inf)
            w = np.exp(scores - scores.max(axis=-1, keepdims=True))
            heads_out.append((w / w.sum(axis=-1, keepdims=True)) @ v[:, kv])
        x = x + np.concatenate(heads_out, axis=-1) @ t[p + "self_attn.o_proj.weight"].T
        h = _rms(x, t[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        if cfg.mlp_kinds and cfg.mlp_kinds[i] == "moe":
            x = x + _experts(t, p + "mlp.", h, cfg)
        else:
            x = x + _swiglu(h, t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"],
                            t[p + "mlp.down_proj.weight"])
    x = _rms(x, t["model.norm.weight"], cfg.rms_norm_eps)
    head = "lm_head.weight" if t.has("lm_head.weight") else "model.embed_tokens.weight"
    return np.concatenate([x @ t.get(head, slice(s, s + VOCAB_BLOCK)).astype(np.float64).T
                           for s in range(0, t.shapes[head][0], VOCAB_BLOCK)], axis=-1)


# ---- running the compiled programs -------------------------------------------------------------------

def _prefill(engine, tokens: list[int], slot: int = 0) -> np.ndarray:
    """Prefill `tokens` into `slot` from position 0 with the programs requests use (the scheduler's
    chunks); the logits at the last token, float32 [vocab]."""
    b, start, logits = engine.buckets, 0, None
    while start < len(tokens):
        chunk = b.chunk_for(len(tokens) - start)
        piece = tokens[start:start + chunk]
        ids = np.zeros((1, chunk), np.int32)
        ids[0, :len(piece)] = piece
        logits = engine.logits(ids, np.array([slot], np.int32), np.array([start], np.int32),
                               np.array([len(piece)], np.int32))
        start += len(piece)
    return logits[0]


def _decode(engine, token: int, position: int, slot: int = 0) -> np.ndarray:
    """One decode step of `slot` with the smallest decode batch (its other rows idle)."""
    b = engine.buckets
    rows = b.decode_batch(1)
    ids, slots = np.zeros((rows, 1), np.int32), np.arange(rows, dtype=np.int32)
    starts, lengths = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    slots[0], ids[0, 0], starts[0], lengths[0] = slot, token, position, 1
    return engine.logits(ids, slots, starts, lengths)[0]


def compare(what: str, got: np.ndarray, want: np.ndarray, tolerance: float) -> str | None:
    """None when `got` matches the reference `want`; else why not."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return f"{what}: the compiled logits are not finite"
    std = float(want.std()) or 1.0
    err = float(np.max(np.abs(got - want))) / std
    if err > tolerance:
        return f"{what}: logits differ from the reference by {err:.2e} deviations (tolerance {tolerance:g})"
    top2 = np.sort(want)[-2:]
    if int(np.argmax(got)) != int(np.argmax(want)) and (top2[1] - top2[0]) / std > 2 * tolerance:
        return (f"{what}: top token {int(np.argmax(got))} where the reference has {int(np.argmax(want))} "
                f"(tolerance {tolerance:g})")
    return None


# Rows the routed-expert check sends through one layer's experts (a prefill chunk's worth would do
# the same; this many already makes every expert of a small model take several rows).
ROUTED_ROWS = 16


def routed_experts_check(engine) -> tuple[str | None, str | None]:
    """Mixture-of-experts models: the first routed layer's experts on fixed activations, through the
    kernel path and the exact path (engine.moe.routed_experts, each forced by cfg.routed_path),
    must agree within the tolerance. (why they disagree or None, what was checked or None for a
    dense model)."""
    cfg = engine.cfg
    if "moe" not in (cfg.mlp_kinds or ()):
        return None, None
    x = np.random.default_rng(0).standard_normal((ROUTED_ROWS, cfg.hidden_size)).astype(np.float32)
    valid = np.ones(ROUTED_ROWS, bool)
    out = {path: engine.routed_experts(x, valid, path) for path in ("kernel", "exact")}
    tolerance = TOLERANCE.get(engine.weights_dtype, TOLERANCE["bfloat16"])
    why = compare("kernel against exact", out["kernel"].ravel(), out["exact"].ravel(), tolerance)
    return why, f"routed experts: kernel path against exact ({ROUTED_ROWS} rows)"


# The reference's logits depend only on the checkpoint (its component set) and the code that reads
# and computes it (this module, engine/checkpoint.py), not on the deployment (--ctx, --slots): they
# are kept per component set, beside the records, so a new deployment of a known model does not
# compute them again. On the demo that computation took 8 s and raised the worker's peak RSS from
# 1.2 to 2.9 GB (a start with a new --ctx, measured).
_CODE_KEY = hashlib.sha256(Path(__file__).read_bytes() +
                           Path(__file__).with_name("checkpoint.py").read_bytes()).hexdigest()[:12]


def reference_path(folder: str | None, component_set_sha: str) -> Path | None:
    """Where the reference logits of this component set are kept (the code's hash in the name:
    changed code computes them again); None where nothing is recorded (folder None)."""
    if folder is None:
        return None
    return Path(folder) / f"{component_set_sha[:24]}-reference-{_CODE_KEY}.npy"


class Reference:
    """The gate's float64 logits at the fixed prompt's last two positions (reference_logits), read
    from `saved` when it holds them, else computed in a thread of its own from the moment it is made
    (a first start runs it beside the weights' quantization and the compiles: on the demo, 2-core EPYC
    of CPU family 25, 7-11 s, most of it decoding the GGUF's blocks again) and written there."""

    def __init__(self, folder: str, cfg, saved: Path | None = None, fresh: bool = False):
        self.tokens = fixed_prompt(cfg.vocab_size)
        self._result: np.ndarray | BaseException | None = None
        self._thread = None
        if is_random(folder):              # never certified (gate): nothing to compute
            return
        if saved is not None and not fresh:
            try:
                kept = np.load(saved)
                if kept.shape == (2, cfg.vocab_size) and kept.dtype == np.float64:
                    self._result = kept
                    return
            except (OSError, ValueError):
                pass

        def work() -> None:
            try:
                self._result = reference_logits(folder, cfg, self.tokens)[-2:]
                if saved is not None:
                    _keep(saved, self._result)
            except BaseException as e:  # noqa: BLE001 - raised again by logits(), in the gate
                self._result = e
        self._thread = threading.Thread(target=work, name="certify-reference", daemon=True)
        self._thread.start()

    def logits(self) -> np.ndarray:
        if self._thread is not None:
            self._thread.join()
        if isinstance(self._result, BaseException):
            raise self._result
        return self._result


def _keep(path: Path, logits: np.ndarray) -> None:
    """Write the logits whole or not at all, and drop this component set's older ones (other code)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            np.save(f, logits)
        os.replace(tmp, path)
        for old in path.parent.glob(path.name.rsplit("-", 1)[0] + "-*.npy"):
            if old != path:
                old.unlink(missing_ok=True)
    except OSError:
        pass                       # not kept: the next new deployment computes them again


def nothing_recorded(folder: str | None, component_set_sha: str) -> bool:
    """Whether no result of the gate is recorded for this component set (any deployment) in `folder`
    (None: nothing ever is). Then the gate will run at this start: its Reference is worth starting
    early."""
    return folder is None or not any(Path(folder).glob(f"{component_set_sha[:24]}-*.json"))


def run(engine, golden: dict | None = None, reference: Reference | None = None,
        saved: Path | None = None, fresh: bool = False) -> tuple[bool, str]:
    """Run every check; (passed, what was checked or why it failed). reference: the float64 logits,
    already under way (else read from `saved` or computed here; fresh: computed)."""
    cfg = engine.cfg
    if "linear" in cfg.layer_kinds:
        return False, ("the float64 reference has no Gated DeltaNet (linear-attention) layers: hybrid "
                       "models are checked against transformers in the test suite only")
    tolerance = TOLERANCE.get(engine.weights_dtype, TOLERANCE["bfloat16"]) + \
        KV_TOLERANCE.get(engine.kv_dtype.name, KV_TOLERANCE["bfloat16"])
    # The checkpoint's own shapes (engine.cfg may lay out more KV heads than it holds).
    if reference is None:
        reference = Reference(engine.args.weights_folder, engine.checkpoint_cfg, saved, fresh)
    tokens = reference.tokens
    want = reference.logits()
    got_prefill = _prefill(engine, tokens[:-1])
    got_decode = _decode(engine, tokens[-1], len(tokens) - 1)
    if os.environ.get(CORRUPT_ENV):
        got_prefill = got_prefill + float(want[-2].std())
    done = [f"reference forward ({len(tokens)} tokens, tolerance {tolerance:g})"]
    for what, got, ref in (("prefill", got_prefill, want[-2]), ("decode", got_decode, want[-1])):
        why = compare(what, got, ref, tolerance)
        if why is not None:
            return False, why
    if golden:
        prompt, answer = list(golden["prompt"]), list(golden["answer"])
        out = [int(np.argmax(_prefill(engine, prompt)))]
        while len(out) < len(answer) and len(prompt) + len(out) < engine.args.ctx:
            out.append(int(np.argmax(_decode(engine, out[-1], len(prompt) + len(out) - 1))))
        if out != answer:
            return False, f"golden: greedy answer {out} where models.json records {answer}"
        done.append(f"golden answer ({len(answer)} tokens)")
    why, checked = routed_experts_check(engine)
    if why is not None:
        return False, f"routed experts: {why}"
    if checked:
        done.append(checked)
    return True, "; ".join(done)


# ---- the record ----------------------------------------------------------------------------------------

def record_path(folder: str, component_set_sha: str, deployment_id: str) -> Path:
    return Path(folder) / f"{component_set_sha[:24]}-{deployment_id[:24]}.json"


def gate(engine, folder: str | None, recertify: bool = False, golden: dict | None = None,
         reference: Reference | None = None) -> tuple[str, str]:
    """("certified" | "not_certified", detail): the recorded result for this component set and
    deployment, or the gate's, run now and recorded (folder None: never recorded). reference: the
    gate's float64 logits if a Reference was started early."""
    if is_random(engine.args.weights_folder):
        return "not_certified", RANDOM_DETAIL
    path = record_path(folder, engine.component_set_sha, engine.deployment_id) if folder else None
    if path is not None and not recertify and path.exists():
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
            if rec.get("certification") in ("certified", "not_certified"):
                return rec["certification"], f"{rec.get('detail', '')} (recorded {rec.get('at', '?')})"
        except (OSError, ValueError):
            pass
    t0 = time.time()
    try:
        passed, detail = run(engine, golden, reference, reference_path(folder, engine.component_set_sha),
                             fresh=recertify)
    except Exception as e:   # noqa: BLE001 - a gate that cannot run certifies nothing
        passed, detail = False, f"the gate could not run: {type(e).__name__}: {e}"
    status = "certified" if passed else "not_certified"
    detail = f"{detail} ({time.time() - t0:.1f} s)"
    if path is not None and not os.environ.get(CORRUPT_ENV):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"certification": status, "detail": detail,
                                        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}),
                            encoding="utf-8")
        except OSError:
            pass
    return status, detail
