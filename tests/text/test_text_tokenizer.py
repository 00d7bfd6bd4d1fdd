import json

import jinja2
import pytest
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from tokenizers import pre_tokenizers

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world! def fib(n):",
    "The capital of France is",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "   leading and trailing spaces   ",
    "tabs\t\tand\r\nwindows newlines\n\n\n",
    "1234567890 3.14159 -42 1e10 2024-01-22 x2",
    "naïve café résumé Ångström façade",
    "日本語のテキスト，中文文本。한국어",
    "emoji 🦀🚀👍🏽 flags 🇫🇷 zwj 👨\u200d👩\u200d👧",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|><|im_start|>",
    "don't I'LL you're it's",
    "`~!@#$%^&*()_+-=[]{}|;':\",./<>?",
    "x" * 300,
    " ",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Leaves fall\nsilently."},
        {"role": "user", "content": "Another, in 日本語 🦀"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir, gguf_file=SMOLLM2_GGUF)


def test_smollm2_special_ids(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x")  # add_bos_token is false
    assert tok.encode("Hello, world! def fib(n):") == [19556, 28, 905, 17, 753, 3987, 24, 94, 727]
    assert tok.encode("<|im_start|>user\nHi<|im_end|>") == [1, 4093, 198, 26843, 2]


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_hf(smollm2_tokenizer, hf_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert smollm2_tokenizer.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text == hf_tokenizer.decode(ids)
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(
        ids, skip_special_tokens=True
    )


def test_digits_are_split_one_per_token(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("31415 926")
    assert [smollm2_tokenizer.decode([i]) for i in ids] == ["3", "1", "4", "1", "5", " ", "9", "2", "6"]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(smollm2_tokenizer, hf_tokenizer, messages, add_generation_prompt):
    ours = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_default_system_prompt_and_generation_prompt(smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_fingerprint_same_from_gguf_and_tokenizer_json(smollm2_tokenizer, hf_tokenizer, tmp_path):
    smollm2_tokenizer.save(tmp_path / "ours")
    hf_tokenizer.save_pretrained(tmp_path / "hf")
    ours, from_hf = TextTokenizer.from_hf_dir(tmp_path / "ours"), TextTokenizer.from_hf_dir(tmp_path / "hf")
    assert ours.fingerprint() == from_hf.fingerprint() == smollm2_tokenizer.fingerprint()
    assert len(smollm2_tokenizer.fingerprint()) == 64
    for tok in (ours, from_hf):
        assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
        assert tok.chat_template == smollm2_tokenizer.chat_template
        assert tok.encode(TEXTS[8]) == smollm2_tokenizer.encode(TEXTS[8])


def test_saved_dir_loads_in_hf(smollm2_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    smollm2_tokenizer.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["chat_template"] == smollm2_tokenizer.chat_template
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert hf.encode(text) == smollm2_tokenizer.encode(text, add_special_tokens=True)
    messages = CONVERSATIONS[1]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        smollm2_tokenizer.apply_chat_template(messages)
    )


# --- small synthetic byte-level vocabularies, shaped like GGUF metadata ---

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_meta(pre: str = "smollm", **overrides) -> dict:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "Ġ w", "1 2", "12 3"]
    tokens = SPECIALS + ["<think>"] + alphabet + ["he", "ll", "hell", "Ġw", "12", "123"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 4] + [1] * (len(tokens) - 4),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    meta.update(overrides)
    return meta


def pieces(tok: TextTokenizer, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text)]


def test_pre_tokenizers_split_digits_as_their_model_expects():
    def split(pre: str) -> list[str]:
        return pieces(TextTokenizer.from_gguf_metadata(tiny_meta(pre)), "hello 12345")

    assert split("smollm")[-5:] == split("qwen2")[-5:] == ["1", "2", "3", "4", "5"]
    assert split("llama-bpe")[-3:] == ["123", "4", "5"]
    assert split("gpt-2")[-4:] == ["Ġ", "123", "4", "5"]
    for pre in ("smollm", "qwen2", "llama-bpe", "gpt-2"):
        tok = TextTokenizer.from_gguf_metadata(tiny_meta(pre))
        assert pieces(tok, "hello world")[:3] == ["hell", "o", "Ġw"]
        for text in TEXTS:
            assert tok.decode(tok.encode(text)) == text


def test_control_and_user_defined_tokens_stay_whole():
    tok = TextTokenizer.from_gguf_metadata(tiny_meta())
    assert tok.encode("<|im_start|>he<think>") == [1, tok.token_to_id("he"), 3]
    assert tok.special_token_ids() == {0, 1, 2}
    assert tok.decode(tok.encode("<|im_start|>he<think>"), skip_special_tokens=True) == "he<think>"


def test_eos_includes_end_of_turn_and_bos_is_honoured():
    tok = TextTokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.ggml.add_bos_token": True}))
    assert tok.eos_token_ids == (0, 2)
    assert tok.encode("he", add_special_tokens=True) == [1, tok.token_to_id("he")]
    assert tok.encode("he") == [tok.token_to_id("he")]


def test_bos_survives_save_and_hf_load(tmp_path):
    from transformers import AutoTokenizer

    tok = TextTokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.ggml.add_bos_token": True}))
    tok.save(tmp_path)
    again = TextTokenizer.from_hf_dir(tmp_path)
    assert again.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=True)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("hello") == again.encode("hello", True)


def test_fingerprint_changes_with_vocabulary():
    base = TextTokenizer.from_gguf_metadata(tiny_meta())
    assert base.fingerprint() == TextTokenizer.from_gguf_metadata(tiny_meta("qwen2")).fingerprint()
    fewer_merges = tiny_meta(**{"tokenizer.ggml.merges": tiny_meta()["tokenizer.ggml.merges"][:-1]})
    assert TextTokenizer.from_gguf_metadata(fewer_merges).fingerprint() != base.fingerprint()
    types = [1] * len(tiny_meta()["tokenizer.ggml.tokens"])
    no_specials = tiny_meta(**{"tokenizer.ggml.token_type": types})
    assert TextTokenizer.from_gguf_metadata(no_specials).fingerprint() != base.fingerprint()


def test_hf_dir_reads_chat_template_file_and_generation_eos(tmp_path):
    tok = TextTokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.chat_template": None}))
    tok.save(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("[{{ messages[0]['content'] }}]{{ eos_token }}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 3]}))
    again = TextTokenizer.from_hf_dir(tmp_path)
    assert again.apply_chat_template([{"role": "user", "content": "q"}]) == "[q]<|endoftext|>"
    assert again.eos_token_ids == (0, 3, 2)


def test_unsupported_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        TextTokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ValueError, match="pre-tokenizer 'falcon'"):
        TextTokenizer.from_gguf_metadata(tiny_meta("falcon"))
    no_template = TextTokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.chat_template": None}))
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_helpers_and_sandbox():
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}\n"
        "  {% for m in messages %}\n{{ bos_token }}{{ m | tojson }}\n  {% endfor %}"
    )
    tok = TextTokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.chat_template": template}))
    out = tok.apply_chat_template([{"role": "user", "content": "é<"}])
    assert out == '<|im_start|>{"role": "user", "content": "é<"}\n'  # trim_blocks + lstrip_blocks
    with pytest.raises(jinja2.TemplateError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    evil = "{{ messages.__class__.__mro__ }}"
    tok = TextTokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.chat_template": evil}))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([])
