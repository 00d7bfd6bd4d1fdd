"""dspark-train end to end on the tiny target: a word-level tokenizer over its 128 ids and a synthetic ShareGPT."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from dspark_grpc.runtime.formats.drafter_formats import load_drafter
from dspark_grpc.train import cli
from tokenizers import Tokenizer, models, pre_tokenizers

from .conftest import VOCAB, Tiny


def add_tokenizer(directory: Path) -> None:
    tk = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="1"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "2", "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}9"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def write_sharegpt(path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    convs = [{"id": f"c{i}_0", "conversations": [
        {"from": "human", "value": " ".join(map(str, torch.randint(3, VOCAB, (6,), generator=g).tolist()))}]}
        for i in range(40)]
    path.write_text(json.dumps(convs)[:-30], encoding="utf-8")  # truncated, like the real file
    return path


def test_cli_trains_calibrates_saves_and_resumes(tiny: Tiny, tmp_path: Path):
    target = Path(shutil.copytree(tiny.path, tmp_path / "target"))
    add_tokenizer(target)
    sharegpt = write_sharegpt(tmp_path / "sharegpt.json")
    args = ["--target", str(target), "--out", str(tmp_path / "out"), "--sharegpt", str(sharegpt),
            "--cache-dir", str(tmp_path / "cache"), "--train-prompts", "24", "--heldout-prompts", "8",
            "--heldout-fraction", "0.3", "--code-prompts", "0", "--max-new-tokens", "12", "--top-k", "8",
            "--layers", "1", "--draft-vocab", "64", "--markov-rank", "8", "--steps", "4", "--batch", "4",
            "--anchors", "4", "--eval-every", "2", "--eval-anchors", "4", "--threads", "1", "--compile", "off",
            "--export", str(tmp_path / "export")]
    assert cli.main(args) == 0
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    assert [e["step"] for e in report["eval"]] == [0, 2, 4] and report["steps"] == 4
    shards = [r for f in (tmp_path / "cache").glob("*/shard-train-*.pt") for r in torch.load(f, weights_only=True)]
    assert report["data"]["train_sequences"] == len(shards) > 0
    assert report["data"]["train_generated_tokens"] == sum(len(r["tokens"]) - r["prompt_len"] for r in shards)
    assert report["data"]["heldout_sequences"] > 0
    cal = report["calibration"]
    assert len(cal["temperatures"]) == 4 and len(cal["ece_before"]) == len(cal["ece_after"]) == 4
    drafter = load_drafter(out / "drafter", target_path=target)
    c = drafter.config
    assert (c.draft_vocab_size, c.num_layers, c.block_size, c.mask_token_id) == (64, 1, 4, VOCAB - 1)
    assert c.confidence_temperatures == tuple(cal["temperatures"])
    exported = load_drafter(tmp_path / "export", target_path=target)  # --export: the same drafter in bf16
    assert exported.config == c
    for (name, a), (_, b) in zip(drafter.state_dict().items(), exported.state_dict().items(), strict=True):
        assert torch.equal(a.to(torch.bfloat16), b.to(torch.bfloat16)) if a.is_floating_point() else \
            torch.equal(a, b), name
    shards = list((tmp_path / "cache").glob("*/shard-*.pt"))
    assert shards
    # resuming a finished run trains no further step and reuses every cached shard
    stamps = {p: p.stat().st_mtime_ns for p in shards}
    assert cli.main([*args, "--resume"]) == 0
    resumed_report = json.loads((out / "report.json").read_text())
    assert [e["step"] for e in resumed_report["eval"]] == [4]
    # the resumed drafter's estimate, not the warm start's
    assert resumed_report["eval"][0]["acceptance_length"] == report["eval"][-1]["acceptance_length"]
    assert {p: p.stat().st_mtime_ns for p in shards} == stamps
    resumed = load_drafter(out / "drafter", target_path=target)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def cli_args(tiny: Tiny, tmp_path: Path) -> list[str]:
    target = Path(shutil.copytree(tiny.path, tmp_path / "target"))
    add_tokenizer(target)
    sharegpt = write_sharegpt(tmp_path / "sharegpt.json")
    return ["--target", str(target), "--out", str(tmp_path / "out"), "--sharegpt", str(sharegpt),
            "--cache-dir", str(tmp_path / "cache"), "--train-prompts", "12", "--heldout-prompts", "6",
            "--heldout-fraction", "0.3", "--code-prompts", "0", "--max-new-tokens", "10", "--top-k", "8",
            "--layers", "1", "--draft-vocab", "64", "--markov-rank", "8", "--steps", "4", "--batch", "4",
            "--anchors", "4", "--eval-every", "2", "--eval-anchors", "4", "--threads", "1", "--compile", "off"]


def test_cli_generate_only_with_the_padded_generator_and_sampled_repeats(tiny: Tiny, tmp_path: Path):
    args = cli_args(tiny, tmp_path)
    assert cli.main([*args, "--generator", "padded", "--sampled-repeats", "2", "--gen-batch", "64",
                     "--generate-only"]) == 0
    assert not (tmp_path / "out" / "report.json").exists()
    records = [r for shard in (tmp_path / "cache").glob("*/shard-train-*.pt")
               for r in torch.load(shard, weights_only=True)]
    first = [r for r in records if "~" not in r["prompt_id"]]
    assert len(records) == 3 * len(first) and first
    assert all(r["mode"] == "sampled" for r in records if "~" in r["prompt_id"])
    for r in records:
        assert r["features"].shape[0] == r["tokens"].shape[0] - 1 and r["topk_ids"].shape[0] == r["tokens"].shape[0] \
            - r["prompt_len"]


@pytest.mark.cuda
def test_cli_on_cuda(tiny: Tiny, tmp_path: Path):
    """The whole run on a GPU (`make gpu-check`): the padded generator, training, calibration and the export."""
    args = cli_args(tiny, tmp_path)
    assert cli.main([*args, "--device", "cuda", "--sampled-repeats", "1", "--time-budget", "5",
                     "--export", str(tmp_path / "export")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [e["step"] for e in report["eval"]] == [0, 2, 4] and report["args"]["device"] == "cuda"
    exported = load_drafter(tmp_path / "export", target_path=tmp_path / "target")
    assert exported.config.num_layers == 1 and exported.device.type == "cpu"


def test_cli_starts_from_a_given_drafter(tiny: Tiny, tmp_path: Path):
    """--init-drafter: the run starts from that drafter (its held-out estimate at step 0 is the one it ended with)
    and keeps its draft vocabulary and shape, whatever the drafter options say."""
    args = cli_args(tiny, tmp_path)
    assert cli.main(args) == 0
    first = json.loads((tmp_path / "out" / "report.json").read_text())
    again = [a if a != str(tmp_path / "out") else str(tmp_path / "again") for a in args]
    assert cli.main([*again, "--init-drafter", str(tmp_path / "out" / "drafter"), "--block-size", "6",
                     "--draft-vocab", "32", "--steps", "2"]) == 0
    second = json.loads((tmp_path / "again" / "report.json").read_text())
    assert second["eval"][0]["acceptance_length"] == first["eval"][-1]["acceptance_length"]
    before = load_drafter(tmp_path / "out" / "drafter", target_path=tmp_path / "target")
    after = load_drafter(tmp_path / "again" / "drafter", target_path=tmp_path / "target")
    assert after.config.block_size == 4 and torch.equal(after.d2t, before.d2t)
    assert not torch.equal(after.fc.weight, before.fc.weight)  # and it trained
