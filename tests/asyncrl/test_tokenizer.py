"""Tokenizer: loading (builtin and HF tokenizer.json), round trips, digits, special tokens, and the
reproducible build of the shipped tiny tokenizer. transformers is the reference for HF behaviour."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from asyncrl.chat_template import GLM_SPECIAL_TOKENS, GlmChatTemplate
from asyncrl.tokenizer import TINY_TOKENIZER_PATH, Tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[2]

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog.",
    "whitespace": "  leading and trailing  \n\n\ttabs\r\nand CRLF   ",
    "unicode": "héllo wörld, 世界 你好, Привет, مرحبا, 🙂🚀 e\u0301 (combining), ﬁ ligature, \u200bzero-width",
    "code": 'def f(xs: list[int]) -> int:\n    return sum(x * 2 for x in xs if x % 3 == 0)  # {"k": [1, 2]}\n',
    "shell": "cd src && grep -rn 'TODO' . | wc -l > /tmp/out.txt 2>&1",
    "digits": "0123456789 3.14159 -42 1e10 2024-06-01 99999999999999999999",
    "empty": "",
}


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return load_tokenizer("builtin:tiny")


def test_builtin_tiny_has_1024_ids_and_glm_special_tokens_at_the_end(tiny):
    assert tiny.vocab_size == 1024
    assert [tiny.token_id(name) for name in GLM_SPECIAL_TOKENS] == list(range(1004, 1024))
    assert tiny.special_tokens == {name: 1004 + i for i, name in enumerate(GLM_SPECIAL_TOKENS)}
    assert tiny.eos_token == "<|endoftext|>" and tiny.eos_token_id == 1004


@pytest.mark.parametrize("allow_special", [True, False])
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip(tiny, name, allow_special):
    ids = tiny.encode(TEXTS[name], allow_special=allow_special)
    assert tiny.decode(ids) == TEXTS[name]
    assert all(0 <= i < tiny.vocab_size for i in ids)


def test_round_trip_of_random_unicode(tiny):
    rng = random.Random(0)
    planes = [(0x20, 0x7F), (0xA0, 0x2FF), (0x370, 0x52F), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x0, 0x20)]
    for _ in range(300):
        text = "".join(chr(rng.randint(*rng.choice(planes))) for _ in range(rng.randint(0, 40)))
        assert tiny.decode(tiny.encode(text)) == text


def test_digits_are_one_token_each(tiny):
    for digit in "0123456789":
        assert tiny.decode(tiny.encode(digit)) == digit and len(tiny.encode(digit)) == 1
    ids = tiny.encode("x = 12345 + 678")
    assert [tiny.decode([i]) for i in ids if tiny.decode([i]).strip().isdigit()] == list("12345678")


def test_special_strings_are_tokens_or_text_on_request(tiny):
    text = "a<|user|>b<tool_call>c"
    assert tiny.encode(text) == [*tiny.encode("a"), 1011, *tiny.encode("b"), 1016, *tiny.encode("c")]
    literal = tiny.encode(text, allow_special=False)
    assert not set(literal) & set(tiny.special_tokens.values())
    assert tiny.decode(literal) == text
    assert tiny.decode(tiny.encode(text), skip_special_tokens=True) == "abc"


def test_unknown_token_name_is_a_clear_error(tiny):
    with pytest.raises(KeyError, match="<nope>"):
        tiny.token_id("<nope>")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer("/nonexistent/dir")


def test_tiny_tokenizer_matches_transformers(tiny):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(TINY_TOKENIZER_PATH))
    for text in [*TEXTS.values(), "<|system|>sys<|user|>What is 2+2?<|assistant|><think></think>4"]:
        ids = tiny.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert tiny.decode(ids) == reference.decode(ids)


def test_build_script_reproduces_the_committed_asset_byte_for_byte(tmp_path):
    out = tmp_path / "tiny_tokenizer.json"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_tiny_tokenizer.py"), "--out", str(out)],
                   check=True, env=env, capture_output=True, timeout=120)  # fmt: skip
    assert out.read_bytes() == TINY_TOKENIZER_PATH.read_bytes()


def _glm_shaped_tokenizer_dir(root: Path) -> Path:
    """A tokenizer.json laid out like GLM-4.5/5.1's (regex split + byte level, reserved tokens appended
    in GLM's order after the BPE vocabulary, extra reserved tokens around them) and its config."""
    backend = HFTokenizer(models.BPE())
    glm_split = Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(glm_split, behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(["hello world", "the tool returned 200 lines", "ls -la /tmp"] * 50, trainer)
    backend.add_special_tokens(list(GLM_SPECIAL_TOKENS) + ["<|begin_of_image|>", "/nothink"])
    model_dir = root / "GLM-shaped"
    model_dir.mkdir()
    backend.save(str(model_dir / "tokenizer.json"))
    config = {"eos_token": {"content": "<|endoftext|>", "special": True}, "pad_token": "<|endoftext|>"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


def test_loads_a_glm_shaped_hf_tokenizer_by_directory_or_file(tmp_path):
    model_dir = _glm_shaped_tokenizer_dir(tmp_path)
    by_dir, by_file = load_tokenizer(model_dir), load_tokenizer(model_dir / "tokenizer.json")
    for tok in (by_dir, by_file):
        base = tok.vocab_size - len(GLM_SPECIAL_TOKENS) - 2
        assert [tok.token_id(n) for n in GLM_SPECIAL_TOKENS] == list(range(base, base + len(GLM_SPECIAL_TOKENS)))
        assert tok.eos_token_id == tok.token_id("<|endoftext|>")
        text = "héllo 世界 <|user|> 12345"
        assert tok.decode(tok.encode(text)) == text
    template = GlmChatTemplate(by_dir)
    message = {"role": "assistant", "content": "done", "reasoning_content": "think",
               "tool_calls": [{"id": "call_0", "type": "function",
                               "function": {"name": "bash", "arguments": '{"command": "ls -la", "n": 3}'}}]}  # fmt: skip
    ids = template.render([{"role": "user", "content": "hi"}, message])
    output = ids[ids.index(by_dir.token_id("<think>")) + 1 :]  # what the model generated after the prompt
    assert template.parse_assistant(output).to_openai() == message
