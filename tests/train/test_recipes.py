"""Recipes (`dspark-train --config`): the shipped drafter's parses to known options and its drafter's shape; the
smoke recipe reruns end to end to the same held-out estimate and exports a drafter that loads."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from dspark_grpc.runtime.formats.checkpoint import default_model_path
from dspark_grpc.runtime.formats.drafter_formats import load_drafter
from dspark_grpc.train import cli

RECIPES = Path(cli.__file__).parent / "recipes"
SHIPPED = RECIPES / "smollm2-135m-instruct-dspark.toml"
SHIPPED_DRAFTER = Path(cli.__file__).parents[1] / "draft_service" / "drafters" / "smollm2-135m-instruct-dspark"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_the_shipped_recipe_names_known_options_and_the_shipped_drafters_shape():
    p = cli.parser()
    recipe = tomllib.loads(SHIPPED.read_text(encoding="utf-8"))
    assert set(recipe) <= set(vars(p.parse_args([]))) - {"config"}
    args = cli.parse_args(p, ["--config", str(SHIPPED)])
    assert {k: getattr(args, k) for k in recipe} == {k: ",".join(map(str, v)) if isinstance(v, list) else v
                                                     for k, v in recipe.items()}
    assert (args.steps, args.restart_at, args.time_budget, args.sampled_repeats) == (4909, 2976, 0.0, 0)
    shipped = json.loads((SHIPPED_DRAFTER / "config.json").read_text(encoding="utf-8"))
    assert (args.layers, args.block_size, args.draft_vocab, args.markov_rank, args.markov_head,
            args.mask_token_id) == (shipped["transformer_layer_config"]["num_hidden_layers"], shipped["block_size"],
                                    shipped["draft_vocab_size"], shipped["markov_rank"], shipped["markov_head_type"],
                                    shipped["mask_token_id"])
    assert [int(i) + 1 for i in args.target_layer_ids.split(",")] == shipped["aux_hidden_state_layer_ids"]


def test_a_config_file_is_overridden_by_the_command_line_and_refuses_unknown_keys(tmp_path: Path, capsys):
    p = cli.parser()
    config = write(tmp_path / "r.toml", 'out = "runs/x"\nsteps = 50\ntarget_layer_ids = [1, 28]\nresume = true\n')
    args = cli.parse_args(p, ["--config", str(config), "--steps", "70"])
    assert (args.out, args.steps, args.target_layer_ids, args.resume) == ("runs/x", 70, "1,28", True)
    for text, message in [("train-prompts = 3\n", "unknown key 'train-prompts' (did you mean 'train_prompts'?)"),
                          ("nonsense = 1\n", "unknown key 'nonsense'"), ("resume = 1\n", "resume = 1: true or false"),
                          ("steps = true\n", "steps = True: not a flag"), ("steps = 'x'\n", "invalid int value"),
                          ("steps = [\n", "--config")]:
        with pytest.raises(SystemExit):
            cli.parse_args(p, ["--config", str(write(tmp_path / "bad.toml", text)), "--out", "o"])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(p, ["--steps", "5"])
    assert "--out is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(p, ["--out", "o", "--steps", "5", "--restart-at", "5"])
    assert "--restart-at 5 must lie" in capsys.readouterr().err


def test_the_smoke_recipe_reruns_to_the_same_estimate(tmp_path: Path):
    """Twice end to end from nothing (a cache each): the same held-out curve, and an exported drafter that loads
    with its report beside it."""
    try:
        target = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    reports = []
    for run in ("a", "b"):
        out = tmp_path / run
        assert cli.main(["--config", str(RECIPES / "smoke.toml"), "--out", str(out), "--cache-dir",
                         str(tmp_path / f"cache-{run}"), "--export", str(out / "export")]) == 0
        report = json.loads((out / "report.json").read_text(encoding="utf-8"))
        assert json.loads((out / "export" / "report.json").read_text(encoding="utf-8")) == report
        reports.append(report)
    a, b = reports
    assert [e["step"] for e in a["eval"]] == [0, 2, 4, 6] and a["steps"] == 6  # 4, then resumed into 6
    assert b["eval"][-1]["acceptance_length"] == pytest.approx(a["eval"][-1]["acceptance_length"], abs=0.02)
    assert [e["loss"] for e in b["eval"]] == pytest.approx([e["loss"] for e in a["eval"]], rel=1e-4)
    assert a["data"]["train_prompts"] == {"code": 7} and a["data"]["heldout_prompts"] == {"code": 3}
    assert a["data"]["train_sequences"] == b["data"]["train_sequences"] == 7
    assert a["data"]["train_generated_tokens"] == b["data"]["train_generated_tokens"] > 0
    assert a["data"]["train_prompts_sha256"] == b["data"]["train_prompts_sha256"]
    assert a["args"]["config"].endswith("smoke.toml") and a["args"]["max_new_tokens"] == 16
    assert a["config"]["sha256"] and a["calibration"]["temperatures"]
    assert a["run"]["torch_version"] and a["run"]["wall_seconds"] > 0 and "commit" in a["run"]
    drafter = load_drafter(tmp_path / "a" / "export", target_path=target)
    assert (drafter.config.num_layers, drafter.config.block_size, drafter.config.draft_vocab_size) == (1, 4, 512)
