import random

import pytest
from dspark_grpc.runtime.formats.detokenize import IncrementalDecoder

TEXTS = [
    "🦀 crabs, 日本語のテキスト and naïve café 👨\u200d👩\u200d👧!",
    "def f():\n\treturn '→ ∑ ≠ 🚀'\n",
    "<|im_start|>assistant\n中文 🇫🇷<|im_end|>",
]


def feed(tokenizer, ids, sizes, **kwargs) -> list[str]:
    decoder = IncrementalDecoder(tokenizer, **kwargs)
    deltas, i = [], 0
    for size in sizes:
        deltas.append(decoder.add(ids[i : i + size]))
        i += size
    assert i == len(ids)
    return [*deltas, decoder.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    deltas = feed(smollm2_tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == smollm2_tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_random_chunks(smollm2_tokenizer, text, skip_special_tokens):
    ids = smollm2_tokenizer.encode(text)
    rng = random.Random(0)
    for _ in range(20):
        sizes, left = [], len(ids)
        while left:
            sizes.append(min(left, rng.randint(0, 4)))
            left -= sizes[-1]
        deltas = feed(smollm2_tokenizer, ids, sizes, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert not any("\ufffd" in d for d in deltas)


def test_emoji_split_across_tokens_is_held_until_complete(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("a🦀")
    assert len(ids) >= 3  # the crab's 4 bytes span several byte-level tokens
    decoder = IncrementalDecoder(smollm2_tokenizer)
    deltas = [decoder.add(i) for i in ids]
    assert deltas[0] == "a" and deltas[-1] == "🦀" and all(d == "" for d in deltas[1:-1])


def test_complete_text_is_not_held_behind_a_partial_character(smollm2_tokenizer):
    crab = smollm2_tokenizer.encode("🦀")
    decoder = IncrementalDecoder(smollm2_tokenizer)
    assert decoder.add(smollm2_tokenizer.encode("ok ") + crab[:1]) == "ok "
    assert decoder.add(crab[1:]) == "🦀"


def test_flush_returns_an_incomplete_tail_like_decode(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("x🦀")[:-1]
    decoder = IncrementalDecoder(smollm2_tokenizer)
    assert decoder.add(ids) == "x"
    tail = decoder.flush()
    assert "x" + tail == smollm2_tokenizer.decode(ids) and tail.endswith("\ufffd")
    assert decoder.flush() == ""
