"""A Hugging Face config.json -> ModelConfig, the static shape of the model.

ModelConfig is frozen and hashable because the jitted forward takes it as a static argument: two
equal configs share compiled programs. Every key is read here, once, with the default Hugging Face
uses when the key is absent, so the model code never looks at raw JSON.

The kind of each layer is decided in ONE place, `_layer_kinds`: what mixes the tokens (full
attention, Qwen3-Next's gated full attention, or its Gated DeltaNet linear attention) and what
follows it (a dense SwiGLU MLP, or routed experts). A new kind is one more name there and one more
branch in engine.model.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

# Families whose every layer is full attention followed by a dense SwiGLU MLP.
DENSE_FAMILIES = ("qwen2", "qwen3")
# Full attention followed by routed experts (some layers may keep a dense MLP).
MOE_FAMILIES = ("qwen3_moe",)
# Gated DeltaNet layers mixed with gated full attention: Qwen3-Next and Qwen3.5's mixture of experts
# (routed experts with a shared expert), Qwen3.5 (a dense MLP in every layer).
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# The model_type a text-only checkpoint (or a multimodal one's text_config) gives its language
# model, and the family it is.
TEXT_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
# Families whose router always renormalizes the picked experts' weights (their configs have no
# norm_topk_prob key: transformers' Qwen3.5 router divides by their sum unconditionally).
ALWAYS_NORM_TOPK = ("qwen3_5_moe",)
SUPPORTED_FAMILIES = DENSE_FAMILIES + MOE_FAMILIES + HYBRID_FAMILIES
# The chat format each family is rendered in where nothing names another (engine.chat.FORMATS: models.json
# or the folder's template can name Qwen3.8's or Qwen3-Coder's); registry and worker read it.
CHAT_FORMAT = {"qwen2": "qwen2.5", "qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen3_next": "qwen3",
               "qwen3_5": "qwen3.5", "qwen3_5_moe": "qwen3.5"}
# Token mixers (ModelConfig.layer_kinds): plain full attention, Qwen3-Next's full attention with a
# sigmoid output gate from the query projection, and its Gated DeltaNet linear attention.
MIXER_KINDS = ("attention", "gated_attention", "linear")
# How the routed experts are computed (engine.moe.routed_experts): "auto" picks per call site by
# platform and shape; "kernel" and "exact" force one path (tests compare them, benchmarks time them).
ROUTED_PATHS = ("auto", "kernel", "exact")

# Hugging Face defaults for keys a config.json may leave out (Qwen2Config / Qwen3Config).
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_NORM_EPS = 1e-6
DEFAULT_MAX_POSITIONS = 32768
# Qwen3NextConfig's defaults: rotary on a quarter of each head, 256-wide heads, one full-attention
# layer in four, and the Gated DeltaNet shapes.
DEFAULT_NEXT_PARTIAL_ROTARY = 0.25
DEFAULT_NEXT_HEAD_DIM = 256
DEFAULT_NEXT_ATTENTION_INTERVAL = 4
DEFAULT_NEXT_LINEAR = {"linear_num_key_heads": 16, "linear_num_value_heads": 32,
                       "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                       "linear_conv_kernel_dim": 4}
# YaRN's rotation bounds, from the YaRN paper (the values every Qwen checkpoint relies on).
DEFAULT_YARN_BETA_FAST = 32.0
DEFAULT_YARN_BETA_SLOW = 1.0

# Bounds on a config's sizes, far above any Qwen checkpoint's (the largest: Qwen2.5-72B's hidden 8,192
# and MLP 29,568, Qwen3-235B's 94 layers, Qwen3-Coder-480B's 96 heads, Qwen3.5's 512 experts and
# 248,320-token vocabulary, Qwen2.5-1M's 1,010,000 positions): a number past one is a damaged or
# hostile file, refused before anything is sized or repeated by it (a layer count of 10^9 made a tuple
# of 10^9 layer kinds; a vocabulary of 2^40, an embedding table no machine holds).
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 17                     # hidden and MLP widths
MAX_VOCAB = 1 << 22
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_EXPERTS = 4096
MAX_POSITIONS = 1 << 24
MAX_CONV_KERNEL = 64                    # the Gated DeltaNet's convolution (Qwen's: 4)
MAX_MTP_LAYERS = 16                     # MTP modules past the trunk (Qwen3.5's and Qwen3-Next's: 1)
# Every integer key read, and its bound (int_problem).
INT_LIMITS = {
    "num_hidden_layers": MAX_LAYERS, "full_attention_interval": MAX_LAYERS, "decoder_sparse_step": MAX_LAYERS,
    "hidden_size": MAX_WIDTH, "intermediate_size": MAX_WIDTH, "moe_intermediate_size": MAX_WIDTH,
    "shared_expert_intermediate_size": MAX_WIDTH, "vocab_size": MAX_VOCAB,
    "num_attention_heads": MAX_HEADS, "num_key_value_heads": MAX_HEADS, "linear_num_key_heads": MAX_HEADS,
    "linear_num_value_heads": MAX_HEADS, "head_dim": MAX_HEAD_DIM, "linear_key_head_dim": MAX_HEAD_DIM,
    "linear_value_head_dim": MAX_HEAD_DIM, "num_experts": MAX_EXPERTS, "num_experts_per_tok": MAX_EXPERTS,
    "max_position_embeddings": MAX_POSITIONS, "original_max_position_embeddings": MAX_POSITIONS,
    "linear_conv_kernel_dim": MAX_CONV_KERNEL, "mtp_num_hidden_layers": MAX_MTP_LAYERS}


class ConfigError(ValueError):
    """config.json cannot be served: the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str                  # a family: DENSE_FAMILIES, MOE_FAMILIES or HYBRID_FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int                   # query heads
    num_kv_heads: int                # key/value heads (grouped-query attention)
    head_dim: int                    # explicit in Qwen3 (not always hidden/heads); derived in Qwen2
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool                   # Qwen2: q/k/v projections carry a bias
    qk_norm: bool                    # Qwen3: RMSNorm over each query and key head before RoPE
    max_position_embeddings: int
    layer_kinds: tuple[str, ...]     # one per layer, what mixes tokens: MIXER_KINDS
    # RoPE scaling: "default" or "yarn"; the rest matter only for "yarn".
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_positions: int = 0
    rope_attention_factor: float | None = None   # None = YaRN's 0.1 * ln(factor) + 1
    rope_beta_fast: float = DEFAULT_YARN_BETA_FAST
    rope_beta_slow: float = DEFAULT_YARN_BETA_SLOW
    rope_truncate: bool = True
    eos_token_ids: tuple[int, ...] = ()
    # One per layer, what follows attention: "dense" (SwiGLU of intermediate_size) or "moe" (routed
    # experts). Empty means every layer is dense.
    mlp_kinds: tuple[str, ...] = ()
    # Routed experts ("moe" layers): a router picks experts_per_token of num_experts by softmax
    # probability; each expert is a SwiGLU MLP of moe_intermediate_size; the picked probabilities
    # are renormalized to sum to 1 when norm_topk_prob.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    routed_path: str = "auto"        # ROUTED_PATHS; not from config.json
    # Qwen3-Next's shared expert: a SwiGLU of this width on every token of a "moe" layer, added to
    # the routed sum through a sigmoid gate (0: none).
    shared_expert_intermediate_size: int = 0
    # Qwen3-Next stores its RMSNorm weights (layer, final and q/k norms) zero-centred: the scale
    # is 1 + w. engine.weights adds the 1 once at load, so the model sees ordinary scales.
    zero_centred_norms: bool = False
    # Dimensions of each head that RoPE rotates (the first ones); the rest pass through. 0: all.
    rotary_dim: int = 0
    # Gated DeltaNet ("linear" layers): heads and head widths of keys (and queries) and values
    # (value heads are a multiple of key heads, each key head serving consecutive value heads), and
    # the width of the short causal depthwise convolution over the projected q, k, v.
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    # Decoder layers of the MTP module past the trunk (mtp_num_hidden_layers; 0: none stated): what a
    # random checkpoint draws under mtp.* (engine.checkpoint.mtp_tensors). Whether a checkpoint
    # holds the module is its own fact (engine.checkpoint.MTP_TENSOR): the drafter reads the first.
    mtp_layers: int = 0
    # Devices of the tensor-parallel mesh the programs are traced for (engine.sharding.Layout sets
    # it; not from config.json): the routed experts run per device (expert parallelism) when > 1.
    devices: int = 1
    # Whether engine.native's kernel serves this model (int8 weights packed for it, decode attention
    # over the int8 cache, the sampler's greedy pick and cuts): decided once at start-up
    # (engine.sharding.Layout, native.serves); not from config.json.
    native: bool = False
    # Whether the model runs one program per layer rather than one of every layer (engine.model:
    # runs_layered, a large model on a CPU): decided once at start-up (engine.sharding.Layout).
    layered: bool = False
    # An official FP8 checkpoint (quantization_config "fp8", fp8_block): its matrices are float8 with
    # block scales, which weights dtype "fp8" holds as they are (engine.weights).
    fp8: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels the Gated DeltaNet convolution runs over: queries, keys, values."""
        return (2 * self.linear_key_heads * self.linear_key_dim
                + self.linear_value_heads * self.linear_value_dim)

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_config(folder: str) -> ModelConfig:
    """Read `folder`/config.json (a Hugging Face model folder) into a ModelConfig."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no config.json in {folder}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return config_from_dict(raw)


def family_of(model_type):
    """The family of a config.json model_type (a text model's type names its family's)."""
    return TEXT_MODEL_TYPES.get(model_type, model_type) if isinstance(model_type, str) else model_type


# Quantized checkpoints: Qwen's official FP8 ones are read (engine.checkpoint dequantizes each weight
# with its block scales as it is loaded); other methods store weights the engine has no reader for.
FP8_DEFAULT_BLOCK = (128, 128)


def fp8_block(raw: dict) -> tuple[int, int] | None:
    """config.json's quantization_config: None when absent, the (rows, columns) of an FP8 checkpoint's
    scale blocks for quant_method "fp8" (e4m3), else a ConfigError naming the method."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "fp8":
        raise ConfigError(f"config.json quantization_config.quant_method {method!r} is not served: use "
                          "the model's bfloat16 or official FP8 checkpoint, or a GGUF of it")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"config.json quantization_config.fmt {quant['fmt']!r} is not served (only e4m3)")
    block = quant.get("weight_block_size") or FP8_DEFAULT_BLOCK
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_WIDTH for n in block)):
        raise ConfigError(f"config.json quantization_config.weight_block_size {block!r} must be two "
                          f"positive integers of at most {MAX_WIDTH:,}")
    return int(block[0]), int(block[1])


def check_weights_dtype(cfg: ModelConfig, weights_dtype: str) -> None:
    """A ConfigError for a weights dtype the checkpoint cannot be held in: fp8 holds an FP8
    checkpoint's own float8 matrices, so a checkpoint without them has nothing to hold so."""
    if weights_dtype == "fp8" and not cfg.fp8:
        raise ConfigError("--weights-dtype fp8 holds an FP8 checkpoint's float8 matrices as they are; this "
                          "checkpoint has none (its config.json has no quantization_config): use int8 or "
                          "bfloat16")


def config_from_dict(raw: dict) -> ModelConfig:
    """The key-by-key reading of a config.json object (split out so tests can feed dicts)."""
    # Multimodal or nested checkpoints keep the language model's keys under text_config.
    if isinstance(raw.get("text_config"), dict):
        raw = {**raw, **raw["text_config"]}
    elif raw.get("text_config") is not None:
        raise ConfigError(f"config.json text_config must be an object, got {raw['text_config']!r:.80}")
    model_type = family_of(raw.get("model_type"))
    if model_type not in SUPPORTED_FAMILIES:
        raise ConfigError(f"config.json model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_FAMILIES)})")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    if raw.get("use_sliding_window", False):
        raise ConfigError("config.json use_sliding_window=true is not supported")
    fp8 = fp8_block(raw) is not None

    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    kv_heads = _int(raw, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(f"config.json num_attention_heads ({heads}) must be a multiple of "
                          f"num_key_value_heads ({kv_heads})")
    head_dim = _head_dim(raw, model_type, hidden, heads)
    num_layers = _int(raw, "num_hidden_layers")
    vocab = _int(raw, "vocab_size")
    rope = _rope(raw)
    layer_kinds, mlp_kinds = _layer_kinds(raw, model_type, num_layers)
    rotary_dim = _rotary_dim(raw, model_type, head_dim)
    _mrope(raw, rotary_dim or head_dim)
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        # Only dense MLP layers read it: Qwen3.5's mixture of experts has none and no key for it.
        intermediate_size=_int(raw, "intermediate_size")
        if "dense" in mlp_kinds or raw.get("intermediate_size") is not None else 0,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(raw, "rms_norm_eps", DEFAULT_RMS_NORM_EPS),
        rope_theta=rope.pop("rope_theta"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases (its config has no key for it); Qwen3 reads attention_bias.
        qkv_bias=True if model_type == "qwen2" else bool(raw.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe") + HYBRID_FAMILIES,
        max_position_embeddings=_int(raw, "max_position_embeddings", DEFAULT_MAX_POSITIONS),
        layer_kinds=layer_kinds,
        mlp_kinds=mlp_kinds,
        eos_token_ids=_eos_ids(raw, vocab),
        **rope,
        **(_experts(raw, model_type) if "moe" in mlp_kinds else {}),
        **(_hybrid(raw) if model_type in HYBRID_FAMILIES else {}),
        rotary_dim=rotary_dim,
        fp8=fp8,
    )


def _head_dim(raw: dict, model_type: str, hidden: int, heads: int) -> int:
    """Qwen3 states head_dim (0.6B: 16 heads x 128 > hidden 1024); Qwen2 derives it."""
    if raw.get("head_dim") is not None:
        head_dim = _int(raw, "head_dim")
    elif model_type in HYBRID_FAMILIES:
        head_dim = DEFAULT_NEXT_HEAD_DIM
    elif hidden % heads:
        raise ConfigError(f"config.json hidden_size ({hidden}) is not a multiple of "
                          f"num_attention_heads ({heads}) and head_dim is absent")
    else:
        head_dim = hidden // heads
    if head_dim % 2:
        raise ConfigError(f"config.json head_dim ({head_dim}) must be even for rotary embeddings")
    return head_dim


def _layer_kinds(raw: dict, model_type: str, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What each layer is: (token mixer per layer, MLP kind per layer). The one place a new layer
    kind gets decided."""
    types = raw.get("layer_types")
    hybrid = model_type in HYBRID_FAMILIES
    if types is None and hybrid:
        # Qwen3-Next without layer_types: every full_attention_interval-th layer is full attention.
        every = _int(raw, "full_attention_interval", DEFAULT_NEXT_ATTENTION_INTERVAL)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(num_layers)]
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError(f"config.json layer_types must list {num_layers} entries "
                              f"(num_hidden_layers), got {types!r}")
        known = {"full_attention", "linear_attention"} if hybrid else {"full_attention"}
        unknown = sorted(set(map(str, types)) - known)
        if unknown:
            raise ConfigError(f"config.json layer_types {unknown} are not supported")
    if hybrid:
        mixers = tuple("gated_attention" if kind == "full_attention" else "linear" for kind in types)
    else:
        mixers = ("attention",) * num_layers
    if model_type not in MOE_FAMILIES + HYBRID_FAMILIES:
        return mixers, ("dense",) * num_layers
    # Qwen3-MoE and Qwen3-Next: layer i has routed experts unless listed in mlp_only_layers, when
    # experts exist and (i + 1) is a multiple of decoder_sparse_step (transformers' decoder layers).
    step = _int(raw, "decoder_sparse_step", 1)
    dense_only = raw.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense_only):
        raise ConfigError(f"config.json mlp_only_layers must list layer indices below "
                          f"{num_layers}, got {dense_only!r}")
    experts = raw.get("num_experts", 0)
    mlps = tuple("moe" if experts and i not in dense_only and (i + 1) % step == 0 else "dense"
                 for i in range(num_layers))
    return mixers, mlps


def _experts(raw: dict, model_type: str) -> dict:
    """The routed-expert keys of a config with "moe" layers; returns ModelConfig fields."""
    experts = _int(raw, "num_experts")
    per_token = _int(raw, "num_experts_per_tok")
    if per_token > experts:
        raise ConfigError(f"config.json num_experts_per_tok ({per_token}) is more than "
                          f"num_experts ({experts})")
    out = {"num_experts": experts, "experts_per_token": per_token,
           "moe_intermediate_size": _int(raw, "moe_intermediate_size"),
           "norm_topk_prob": model_type in ALWAYS_NORM_TOPK or bool(raw.get("norm_topk_prob", False))}
    if model_type in HYBRID_FAMILIES:
        out["shared_expert_intermediate_size"] = _int(raw, "shared_expert_intermediate_size")
    elif raw.get("shared_expert_intermediate_size"):
        raise ConfigError(f"config.json shared_expert_intermediate_size: {model_type} has no "
                          f"shared expert (only qwen3_next)")
    return out


def _hybrid(raw: dict) -> dict:
    """Qwen3-Next's Gated DeltaNet shapes; returns ModelConfig fields."""
    if raw.get("attention_bias", False):
        raise ConfigError("config.json attention_bias=true is not supported for hybrid models")
    key_heads = _int(raw, "linear_num_key_heads", DEFAULT_NEXT_LINEAR["linear_num_key_heads"])
    value_heads = _int(raw, "linear_num_value_heads", DEFAULT_NEXT_LINEAR["linear_num_value_heads"])
    if value_heads % key_heads:
        raise ConfigError(f"config.json linear_num_value_heads ({value_heads}) must be a multiple "
                          f"of linear_num_key_heads ({key_heads})")
    return {"zero_centred_norms": True, "linear_key_heads": key_heads,
            "linear_value_heads": value_heads,
            "linear_key_dim": _int(raw, "linear_key_head_dim", DEFAULT_NEXT_LINEAR["linear_key_head_dim"]),
            "linear_value_dim": _int(raw, "linear_value_head_dim",
                                     DEFAULT_NEXT_LINEAR["linear_value_head_dim"]),
            "linear_conv_kernel": _int(raw, "linear_conv_kernel_dim",
                                       DEFAULT_NEXT_LINEAR["linear_conv_kernel_dim"]),
            "mtp_layers": _int(raw, "mtp_num_hidden_layers") if raw.get("mtp_num_hidden_layers", 0) != 0 else 0}


def _rotary_dim(raw: dict, model_type: str, head_dim: int) -> int:
    """Dimensions of each head RoPE rotates: head_dim x partial_rotary_factor (top level or in
    rope_parameters; Qwen3-Next defaults to a quarter), 0 meaning all of them. Only Qwen3-Next
    reads the factor (the dense families rotate whole heads)."""
    if model_type not in HYBRID_FAMILIES:
        return 0
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor",
                        raw.get("partial_rotary_factor", DEFAULT_NEXT_PARTIAL_ROTARY))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"config.json partial_rotary_factor must be in (0, 1], got {factor!r}")
    dim = int(head_dim * factor)
    if dim % 2 or dim == 0:
        raise ConfigError(f"config.json partial_rotary_factor {factor} gives {dim} rotary "
                          f"dimensions of head_dim {head_dim}; it must be a positive even number")
    return 0 if dim == head_dim else dim


def _rope(raw: dict) -> dict:
    """RoPE keys, from either the classic layout (rope_theta + rope_scaling) or the newer
    rope_parameters dict; returns ModelConfig fields."""
    params = {**_object(raw, "rope_scaling"), **_object(raw, "rope_parameters")}
    theta = _positive("rope_theta", params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    out = {"rope_theta": theta, "rope_type": kind}
    if kind == "default":
        return out
    if kind != "yarn":
        raise ConfigError(f"config.json rope type {kind!r:.80} is not supported (default, yarn)")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("config.json yarn rope scaling needs original_max_position_embeddings")
    original = _int(params, "original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = _int(raw, "max_position_embeddings") / original
    attention = params.get("attention_factor")
    out.update(
        rope_factor=_positive("rope factor", factor),
        rope_original_max_positions=original,
        rope_attention_factor=None if attention is None else _positive("rope attention_factor", attention),
        rope_beta_fast=_positive("rope beta_fast", params.get("beta_fast") or DEFAULT_YARN_BETA_FAST),
        rope_beta_slow=_positive("rope beta_slow", params.get("beta_slow") or DEFAULT_YARN_BETA_SLOW),
        rope_truncate=bool(params.get("truncate", True)),
    )
    return out


def _mrope(raw: dict, rope_dim: int) -> None:
    """Qwen3.5's mrope_section (rope_parameters): how the rotated frequencies split between time, height
    and width positions, which a text-only prompt gives alike; checked to be such a split of them."""
    params = {**_object(raw, "rope_scaling"), **_object(raw, "rope_parameters")}
    section = params.get("mrope_section")
    if section is None:
        return
    if (not isinstance(section, list) or len(section) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in section)
            or sum(section) != rope_dim // 2):
        raise ConfigError(f"config.json mrope_section must be 3 counts summing to half the {rope_dim} rotary "
                          f"dimensions, got {section!r:.80}")


def _object(raw: dict, key: str) -> dict:
    """A key holding an object (rope_scaling, rope_parameters); absent or null: {}."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"config.json {key} must be an object, got {value!r:.80}")
    return value


def _eos_ids(raw: dict, vocab: int) -> tuple[int, ...]:
    """eos_token_id (an id or a list of them), each a token of the vocabulary."""
    eos = raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ConfigError(f"config.json eos_token_id {eos!r:.80} must be token ids of the {vocab}-token "
                              "vocabulary")
    return tuple(ids)


def int_problem(key: str, value) -> str | None:
    """What is wrong with `value` as the integer key `key` (positive, within INT_LIMITS), or None."""
    most = INT_LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= most:
        return f"must be a positive integer of at most {most:,}, got {value!r}"
    return None


def float_problem(value) -> str | None:
    """What is wrong with `value` as a positive number (NaN and the infinities are not), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        return f"must be a positive number, got {value!r}"
    return None


def _int(raw: dict, key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    problem = int_problem(key, value)
    if problem:
        raise ConfigError(f"config.json {key} {problem}")
    return value


def _float(raw: dict, key: str, default: float) -> float:
    return _positive(key, raw.get(key, default))


def _positive(key: str, value) -> float:
    problem = float_problem(value)
    if problem:
        raise ConfigError(f"config.json {key} {problem}")
    return float(value)
