"""Prompts (truncated ShareGPT JSON, splits, order), packed generation, feature extraction and the shard cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dspark_grpc.runtime.drafting.sampling import SamplingParams
from dspark_grpc.train import data
from dspark_grpc.train.data import (
    FeatureCache,
    GenerationSettings,
    Prompt,
    code_prompts,
    extract_features,
    generate_batch,
    generate_padded,
    is_heldout,
    iter_json_array,
    read_sharegpt,
    shuffle_prompts,
    split_prompts,
)
from tolerance import hidden_tolerance, log_softmax_error, logits_tolerance, unit_roundoff

from .conftest import EOS, LAYER_IDS, Tiny, prompts


def assert_same_record(a: data.TargetSequence, b: data.TargetSequence, model, logsumexp: bool = True) -> None:
    """Two float32 computations of one sequence's records (other batch shapes, caches, chunks): tests/tolerance.py's
    bounds for the tiny target over the sequence: its captured hidden states (then each rounded to bf16: 2^-8 of
    either value more) and its top-k logits and their logsumexp (a log-sum-exp over the vocabulary more)."""
    context = a.tokens.numel()
    features = b.features.float()
    atol = hidden_tolerance(model.config, context, max(LAYER_IDS) + 1, features)
    u = unit_roundoff(torch.bfloat16)
    torch.testing.assert_close(a.features.float(), features, atol=atol, rtol=2 * u / (1 - u))
    logits = logits_tolerance(model, context)
    torch.testing.assert_close(a.topk_values, b.topk_values, atol=logits, rtol=0)
    if logsumexp:
        vocab, z_max = model.config.vocab_size, float(b.topk_values.abs().max())
        torch.testing.assert_close(a.logsumexp, b.logsumexp, atol=logits + 2 * log_softmax_error(vocab, z_max), rtol=0)


def conversation(cid: str, first: str, text: str) -> dict:
    return {"id": cid, "conversations": [{"from": first, "value": text}, {"from": "gpt", "value": "reply {x}"}]}


def write_truncated(path: Path) -> Path:
    good = [conversation("a_0", "human", "first question"), conversation("b_0", "gpt", "no human turn"),
            conversation("c_1", "human", "  third  "), conversation("d_0", "human", "")]
    body = ",\n".join(json.dumps(c, indent=2) for c in good)
    broken = '{"id": "bad_0", "conversations": [{"from": "human", "value": "unterminated}]},\n'
    after = json.dumps(conversation("e_0", "human", "after the broken one"), indent=2)
    tail = json.dumps(conversation("f_0", "human", "cut off"), indent=2)[:40]
    path.write_text("[\n" + body + ",\n" + broken + after + ",\n" + tail, encoding="utf-8")
    return path


def test_sharegpt_reader_skips_malformed_objects_and_the_truncated_tail(tmp_path: Path):
    path = write_truncated(tmp_path / "sharegpt.json")
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    got = read_sharegpt(path)
    assert [(p.id, p.text) for p in got] == [("a_0", "first question"), ("c_1", "third"),
                                             ("e_0", "after the broken one")]
    assert {p.source for p in got} == {"sharegpt"}
    assert list(iter_json_array("[1, 2, {\"a\": [3]}]")) == [1, 2, {"a": [3]}]
    assert list(iter_json_array("[]")) == [] and list(iter_json_array("no array")) == []


def test_split_and_shuffle_are_deterministic_and_keep_conversations_together():
    ps = [Prompt(f"conv{i}_{j}", "x", "sharegpt") for i in range(300) for j in range(2)]
    train, heldout = split_prompts(ps, 0.1)
    assert len(train) + len(heldout) == len(ps) and 20 < len(heldout) < 100
    assert split_prompts(list(reversed(ps)), 0.1)[1] == list(reversed(heldout))
    for i in range(300):
        assert is_heldout(f"conv{i}_0", 0.1) == is_heldout(f"conv{i}_1", 0.1)
    order = shuffle_prompts(ps, seed=3)
    assert order == shuffle_prompts(list(reversed(ps)), seed=3) and order != ps
    assert shuffle_prompts(ps[:100], seed=3) == [p for p in order if p in set(ps[:100])]
    assert shuffle_prompts(ps, seed=4) != order


def test_sampled_repeats_are_sampled_and_stay_with_their_conversation():
    base = [Prompt("abc_0", "one", "sharegpt"), Prompt("code-001", "two", "code")]
    repeated = data.sampled_repeats(base, 2)
    assert [p.id for p in repeated] == ["abc_0", "code-001", "abc_0~1", "code-001~1", "abc_0~2", "code-001~2"]
    assert [p.text for p in repeated[2:4]] == ["one", "two"]
    settings = GenerationSettings(sampled_fraction=0.0)
    assert [settings.mode(p.id, False) for p in repeated] == ["greedy"] * 2 + ["sampled"] * 4
    assert settings.prompt_seed("abc_0~1") != settings.prompt_seed("abc_0~2")
    assert data.conversation_id("abc_0~2") == "abc" and data.conversation_id("code-001~1") == "code-001"
    assert is_heldout("abc_0~1", 0.3) == is_heldout("abc_7", 0.3)


def test_code_prompts_are_ours_and_stable():
    base = code_prompts()
    assert len(base) == len(data.CODE_TASKS) and all(p.source == "code" for p in base)
    more = code_prompts(stdlib_docstrings=5)
    assert more[: len(base)] == base and len(more) == len(base) + 5 and more == code_prompts(5)
    assert all(p.id.startswith("doc-") and "Write a Python function" in p.text for p in more[len(base):])


def test_training_code_tasks_are_not_near_duplicates_of_the_bench_prompts():
    # the bench measures drafters on docs/prompts/heldout.jsonl: no training task may be (nearly) one of them
    import re

    def words(text: str) -> set[str]:
        return set(re.findall(r"[a-z0-9]+", text.lower()))

    heldout = Path(__file__).resolve().parents[2] / "docs" / "prompts" / "heldout.jsonl"
    bench = [item.get("prompt") or item["messages"][-1]["content"]
             for item in map(json.loads, heldout.read_text(encoding="utf-8").splitlines()) if item]
    for task in code_prompts(stdlib_docstrings=400):
        for prompt in bench:
            a, b = words(task.text), words(prompt)
            assert len(a & b) / len(a | b) < 0.55, (task.text, prompt)


def test_packed_generation_equals_one_prompt_at_a_time(tiny: Tiny):
    ps = prompts(3, 7)
    packed = generate_batch(tiny.model, ps, LAYER_IDS, 10, top_k=8, eos_ids=(EOS,))
    for p, seq in zip(ps, packed, strict=True):
        alone = generate_batch(tiny.model, [p], LAYER_IDS, 10, top_k=8, eos_ids=(EOS,))[0]
        assert torch.equal(seq.tokens, alone.tokens) and seq.prompt_len == len(p)
        assert_same_record(seq, alone, tiny.model, logsumexp=False)
        # greedy labels are the target's own argmax, and generation stops at EOS
        assert torch.equal(seq.generated, seq.topk_ids[:, 0])
        assert EOS not in seq.generated[:-1].tolist()
        assert seq.generated.numel() == 10 or int(seq.generated[-1]) == EOS


def test_padded_generation_equals_the_serving_forward(tiny: Tiny):
    """One left-padded batch (prompts of different lengths, finished ones dropped as it goes) against generate_batch,
    the serving forward's per-sequence caches: the same greedy tokens, features and teacher logits."""
    ps = prompts(9, 11)
    assert len({len(p) for p in ps}) > 2
    free = generate_batch(tiny.model, ps, LAYER_IDS, 20, top_k=8)
    stops = (int(free[0].generated[5]), int(free[3].generated[12]), int(free[6].generated[9]))  # "EOS" ids: early ends
    ref = generate_batch(tiny.model, ps, LAYER_IDS, 20, top_k=8, eos_ids=stops)
    padded = generate_padded(tiny.model, ps, LAYER_IDS, 20, top_k=8, eos_ids=stops)
    early = sum(s.generated.numel() < 20 for s in ref)
    assert early >= 3 and early < len(ps)  # enough to shrink the padded batch, not all
    for a, b in zip(ref, padded, strict=True):
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len and b.mode == "greedy"
        assert b.features.shape == a.features.shape and b.features.dtype == torch.bfloat16
        assert_same_record(b, a, tiny.model)
        assert (b.topk_ids == a.topk_ids).float().mean() > 0.95


def test_padded_sampling_is_seeded_and_its_teacher_rows_are_the_targets(tiny: Tiny):
    """Sampled rows of a padded batch: seeded (the same batch draws the same tokens), each draw's teacher row is
    the target's own logits at that point (checked by a fresh prefill), and a greedy row beside them stays greedy."""
    ps, params = prompts(4, 13), SamplingParams(temperature=1.0)
    modes = [params, None, params, params]
    a = generate_padded(tiny.model, ps, LAYER_IDS, 16, top_k=8, sampling=modes, seeds=[3, 0, 4, 5])
    b = generate_padded(tiny.model, ps, LAYER_IDS, 16, top_k=8, sampling=modes, seeds=[3, 0, 4, 5])
    c = generate_padded(tiny.model, ps, LAYER_IDS, 16, top_k=8, sampling=modes, seeds=[8, 0, 4, 5])
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, c, strict=True))
    greedy = generate_batch(tiny.model, ps[1:2], LAYER_IDS, 16, top_k=8)[0]
    assert torch.equal(a[1].tokens, greedy.tokens) and a[1].mode == "greedy"
    assert [s.mode for s in a] == ["sampled", "greedy", "sampled", "sampled"]
    assert any(not torch.equal(s.generated, s.topk_ids[:, 0]) for s in (a[0], a[2], a[3]))
    for seq in (a[0], a[2]):
        again = extract_features(tiny.model, seq.tokens.tolist(), seq.prompt_len, LAYER_IDS, top_k=8)
        assert_same_record(seq, again, tiny.model, logsumexp=False)


def test_generation_records_equal_a_fresh_prefill_of_the_final_tokens(tiny: Tiny):
    for seq in tiny.train[:4]:
        again = extract_features(tiny.model, seq.tokens.tolist(), seq.prompt_len, LAYER_IDS, top_k=8, chunk_size=5)
        assert again.features.shape == seq.features.shape == (seq.tokens.numel() - 1, len(LAYER_IDS), 32)
        assert_same_record(again, seq, tiny.model)
        assert (again.topk_ids == seq.topk_ids).float().mean() > 0.95  # ties at the k-th logit may swap


def test_sampled_generation_is_seeded_per_prompt(tiny: Tiny):
    ps, params = prompts(2, 9), SamplingParams(temperature=1.0)
    a = generate_batch(tiny.model, ps, LAYER_IDS, 16, sampling=[params, params], seeds=[5, 6])
    b = generate_batch(tiny.model, ps[:1], LAYER_IDS, 16, sampling=[params], seeds=[5])
    c = generate_batch(tiny.model, ps, LAYER_IDS, 16, sampling=[params, params], seeds=[7, 6])
    assert torch.equal(a[0].tokens, b[0].tokens) and a[0].mode == "sampled"
    assert not torch.equal(a[0].tokens, c[0].tokens) and torch.equal(a[1].tokens, c[1].tokens)


class CountingTokenizer:
    eos_token_ids = (EOS,)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return messages[0]["content"]

    def encode(self, text, add_special_tokens=False):
        return [int(x) for x in text.split()]


def test_feature_cache_round_trip_and_resume(tiny: Tiny, tmp_path: Path):
    ps = [Prompt(f"p{i}", " ".join(map(str, p)), "code") for i, p in enumerate(prompts(5, 11))]
    settings = GenerationSettings(max_new_tokens=6, top_k=4, sampled_fraction=0.5, seed=1)
    key = data.cache_key("tiny", LAYER_IDS, settings, 64, 0.1)
    cache = FeatureCache(tmp_path, key)
    calls = []
    real = data.generate_batch

    def counting(*args, **kwargs):
        calls.append(kwargs.get("prompt_ids", args[-1]))
        return real(*args, **kwargs)

    first = data.build_sequences(tiny.model, CountingTokenizer(), ps, LAYER_IDS, settings, cache, shard_size=2,
                                 generate=counting)
    assert len(calls) == 3 and len(list(cache.dir.glob("shard-*.pt"))) == 3
    assert {s.mode for s in first} <= {"greedy", "sampled"}
    again = data.build_sequences(tiny.model, CountingTokenizer(), ps, LAYER_IDS, settings, cache, shard_size=2,
                                 generate=counting)
    assert len(calls) == 3
    for a, b in zip(first, again, strict=True):
        for name in ("tokens", "features", "topk_values", "topk_ids", "logsumexp"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert (a.prompt_id, a.mode, a.prompt_len) == (b.prompt_id, b.mode, b.prompt_len)
    # an interrupted run: the missing shard alone is generated again, with the same result
    missing = cache.shard_path(1, ["p2", "p3"])
    missing.unlink()
    resumed = data.build_sequences(tiny.model, CountingTokenizer(), ps, LAYER_IDS, settings, cache, shard_size=2,
                                   generate=counting)
    assert len(calls) == 4 and missing.exists()
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(first, resumed, strict=True))
    # a longer prompt list reuses the shards of the shorter one
    longer = data.build_sequences(tiny.model, CountingTokenizer(), ps + [Prompt("p9", "5 6 7", "code")], LAYER_IDS,
                                  settings, cache, shard_size=2, generate=counting)
    assert len(calls) == 5 and len(longer) == 6
    # held-out prompts are always greedy; other keys get other directories
    held = data.build_sequences(tiny.model, CountingTokenizer(), ps[:2], LAYER_IDS, settings, cache, heldout=True,
                                generate=counting)
    assert {s.mode for s in held} == {"greedy"} and len(calls) == 6
    assert cache.shard_path(0, ["p0", "p1"], "heldout").exists()
    assert FeatureCache(tmp_path, {**key, "top_k": 8}).dir != cache.dir
    assert json.loads((cache.dir / "meta.json").read_text())["layer_ids"] == list(LAYER_IDS)


def test_feature_cache_checksums_find_a_corrupted_shard_and_generate_it_again(tiny: Tiny, tmp_path: Path, capsys):
    ps = [Prompt(f"p{i}", " ".join(map(str, p)), "code") for i, p in enumerate(prompts(5, 11))]
    settings = GenerationSettings(max_new_tokens=6, top_k=4, sampled_fraction=0.5, seed=1)
    cache = FeatureCache(tmp_path, data.cache_key("tiny", LAYER_IDS, settings, 64, 0.1))
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[-1])
        return generate_batch(*args, **kwargs)

    def build() -> list[data.TargetSequence]:
        return data.build_sequences(tiny.model, CountingTokenizer(), ps, LAYER_IDS, settings, cache, shard_size=2,
                                    generate=counting)

    first = build()
    shards = sorted(cache.dir.glob("shard-*.pt"))
    assert cache.manifest() == {p.name: data.file_sha256(p) for p in shards} and len(shards) == 3 == len(calls)
    corrupted = cache.shard_path(1, ["p2", "p3"])
    raw = bytearray(corrupted.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a flipped bit in a tensor still loads: only the checksum tells
    corrupted.write_bytes(bytes(raw))
    with pytest.raises(data.CorruptShard, match="is not the .* its manifest recorded"):
        cache.load(1, ["p2", "p3"])  # a reader that cannot generate refuses it
    stamps = {p: p.stat().st_mtime_ns for p in shards if p != corrupted}
    again = build()
    assert calls == [["p0", "p1"], ["p2", "p3"], ["p4"], ["p2", "p3"]]
    assert f"{corrupted}: sha256" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert cache.manifest()[corrupted.name] == data.file_sha256(corrupted)
    assert all(torch.equal(a.features, b.features) for a, b in zip(first, again, strict=True))
    # a shard the manifest does not know (written before manifests) is recorded when read; one cut short is refused
    (cache.dir / FeatureCache.MANIFEST).unlink()
    last = cache.shard_path(2, ["p4"])
    last.write_bytes(last.read_bytes()[:100])
    build()
    assert calls[4:] == [["p4"]] and "does not load" in capsys.readouterr().err
    assert cache.manifest() == {p.name: data.file_sha256(p) for p in shards}
