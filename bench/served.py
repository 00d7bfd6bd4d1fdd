"""`dspark bench`: AR vs speculative decoding side by side, over gRPC, at several concurrencies.

One process tree: the bench (threads, one TargetClient call per request) and the two services, started here
on free loopback ports unless addresses are given. Greedy, EOS honoured. Torch-free (other engines' baselines run
as child processes).

Metrics (vLLM spec-decode semantics, aggregated over all requests of one mode and concurrency):
- tokens_per_s: generated tokens of all requests / wall time of the batch (first submit to last finish). At
  concurrency 1 the modes are interleaved (each prompt in every mode, then the next prompt) and the wall time is
  the sum of the mode's request times, so a slow drift of the machine's speed does not favour one mode. At
  concurrency > 1 each of the `--repeat` runs of a mode also has its own figure (runs_tokens_per_s): their spread
  is the machine's run-to-run noise, against which a ratio between modes must be read.
- acceptance_length: sum(generated - 1) / sum(target steps): tokens committed per target forward, bonus
  included (the prefill's token is no decode step's).
- per_position_acceptance[d]: accepted at depth d+1 / drafted at depth d+1, pooled over all requests from the
  per-depth counts each request reports (GenerationStats.drafted_per_position / accepted_per_position).
- forward_sessions / forward_rows: mean sessions and rows of the target forward a step ran in; draft_pass_sessions:
  mean sessions of the drafter pass a drafting step drafted in (how well speculative rounds batch).
- client_bytes_per_step / client_capture_bytes_per_step: bytes of session ops through the client per step, and
  the hidden-state captures among them (0: captures go target -> drafter only); draft_ahead_hit_rate: drafting
  steps whose proposal was ready when the step began; from_chain_rate: those whose proposal was the rest of the
  step before's chain (no drafter round); from_lookup_rate: those whose proposal the target found by prompt
  lookup in the session's own tokens (no drafter round).
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from dspark_grpc.bench.delay_proxy import delay_proxy
from dspark_grpc.bench.machine import git_commit, machine_info
from dspark_grpc.client.local_stack import local_drafter, local_target
from dspark_grpc.client.sdk import MODES, GenerationResult, TargetClient, drafter_info
from dspark_grpc.speculation.wire import ADAPTIVE, AR, AUTO, CHAIN, DEFAULT_PROPOSER, SPECULATION

DRAFTER_MODES = (SPECULATION, ADAPTIVE)
OVERRIDES = ("proposal", "proposer", "kernel", "budget")


def parse_mode(name: str) -> tuple[str, dict]:
    """'speculation/proposal=tree/proposer=ngram' -> ('speculation', {'proposal': 'tree', 'proposer': 'ngram'}):
    one bench run can compare several speculation settings against one AR pass."""
    mode, *options = name.split("/")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {tuple(MODES)}")
    overrides = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in OVERRIDES or not value:
            raise ValueError(f"{name!r}: options are /key=value with key in {OVERRIDES}")
        overrides[key] = int(value) if key == "budget" else value
    return mode, overrides


def run_bench(prompts: list[dict], modes: list[str], max_new_tokens: int, concurrency: list[int],
              target: str | None = None, drafter: str | None = None, proposal: str = CHAIN, budget: int = 0,
              kernel: str = AUTO, *, proposer: str = DEFAULT_PROPOSER, ignore_eos: bool = False,
              drafter_checkpoint: str | None = None,
              target_model: str | None = None,
              draft_timeout: float = 10.0, prompts_file: str | None = None, command: list[str] | None = None,
              cost_profile: bool = True, connect_timeout: float = 15.0, link_delay_ms: float = 0.0,
              baselines: tuple[str, ...] = (), target_args: tuple[str, ...] = (),
              drafter_args: tuple[str, ...] = (), repeat: int = 1, device: str | None = None,
              log: Callable[[str], None] | None = None) -> dict:
    """Run every prompt in every mode at every concurrency; returns the JSON-ready result (module docstring).

    Services whose address is not given are started here (target: the default model or `target_model`;
    drafter: `drafter_checkpoint`, else the draft service's default: the shipped drafter for the embedded target)
    and stopped at the end (`target_args`, `drafter_args`: more arguments for them; `device`: their --device).
    `link_delay_ms` puts a delaying proxy (bench/delay_proxy.py) on every link: client -> target and, for a target
    started here, target -> drafter. `baselines` ("llama-cpp") run before the services start and again after they
    stop, as child processes of this one (the machine's drift during the modes then hits the baseline about alike;
    its figures sum both runs). At concurrency > 1 the modes run one after the other, `repeat` times in turn (a drift
    of the machine's speed then hits every mode alike); a mode's figures sum its repeats.
    """
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    _check_args(prompts, modes, max_new_tokens, concurrency)
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise ValueError(f"unknown baselines {sorted(unknown)}; known: {list(BASELINES)}")
    needs_drafter = any(parse_mode(m)[0] in DRAFTER_MODES for m in modes)
    sessions = str(max(16, 2 * max(concurrency)))
    # for the services started here
    service_args = ([] if cost_profile else ["--no-cost-profile"]) + (["--device", device] if device else [])
    started = []
    baseline_before = {}
    for name in baselines:
        log(f"[bench] baseline {name} (before the modes): {len(prompts)} prompts")
        baseline_before[name] = BASELINES[name](prompts, max_new_tokens, ignore_eos, target_model)
    with ExitStack() as stack:
        if target is not None and drafter is not None:
            raise ValueError("--drafter is the draft service a started target uses; a running target (--target) "
                             "drafts with the drafter it was started with")
        if target is None and drafter is None and needs_drafter:
            started.append("draft")
            log(f"[bench] starting the draft service ({drafter_checkpoint or 'its default drafter'})")
            # (its one target holds all its draft sessions: no per-principal cap)
            args = (["--drafter", drafter_checkpoint] if drafter_checkpoint else []) + \
                ["--max-sessions", sessions, "--max-sessions-per-principal", "0", *service_args, *drafter_args]
            # SERVING before the target starts: the two start-up cost profiles must not share the CPU
            drafter = stack.enter_context(local_drafter(args + (["--target-model", target_model]
                                                                if target_model else []), wait_serving=True))
        if drafter is not None and link_delay_ms > 0:
            drafter = stack.enter_context(delay_proxy(drafter, link_delay_ms / 1000))
        if target is None:
            started.insert(0, "target")
            log("[bench] starting the target service" + (f" ({target_model})" if target_model else ""))
            args = ["--max-sessions", sessions, "--draft-timeout", str(draft_timeout), *service_args] + \
                (["--model", target_model] if target_model else []) + (["--drafter", drafter] if drafter else []) + \
                list(target_args)
            target = stack.enter_context(local_target(args, wait_serving=True))
        if link_delay_ms > 0:
            target = stack.enter_context(delay_proxy(target, link_delay_ms / 1000))
        client = stack.enter_context(TargetClient(target, proposal=proposal, budget=budget, kernel=kernel,
                                                  proposer=proposer))
        client.wait_ready(timeout=600, unreachable_after=connect_timeout)
        info = client.model_info()
        config = {
            "prompts_file": prompts_file, "num_prompts": len(prompts), "modes": list(modes),
            "max_new_tokens": max_new_tokens, "concurrency": list(concurrency), "repeat": repeat, "proposal": proposal,
            "proposer": proposer,
            "budget": budget, "kernel": kernel, "temperature": 0.0, "ignore_eos": ignore_eos,
            "draft_timeout_s": draft_timeout, "target": target, "drafter": drafter, "started_services": started,
            "cost_profile": cost_profile, "device": device, "link_delay_ms": link_delay_ms,
            "target_args": list(target_args),
            "drafter_args": list(drafter_args),
            "drafter_checkpoint": drafter_checkpoint, "target_model": target_model,
            **({"commit": commit} if (commit := git_commit()) else {}),
            "target_info": {"model_name": info.model_name, "architecture": info.architecture,
                            "num_layers": info.num_layers, "device": info.device,
                            "speculation_available": info.speculation_available},
        }
        if drafter is not None:
            d = drafter_info(drafter)
            config["drafter_info"] = {"name": d.name, "block_size": d.block_size,
                                      "target_layer_ids": list(d.target_layer_ids), "markov_rank": d.markov_rank}

        for mode in modes:  # warm-up (not timed): first calls, lazy compilation, allocator growth
            t0 = time.perf_counter()
            _request(client, prompts[0], mode, min(max_new_tokens, 16))
            log(f"[bench] warm-up {mode}: {time.perf_counter() - t0:.2f} s")

        results: dict[str, dict[str, dict]] = {m: {} for m in modes}
        for c in concurrency:
            if c == 1:  # one prompt in every mode, then the next: a drift of the machine's speed hits all modes
                entries = _run_interleaved(client, prompts, modes, max_new_tokens, log, ignore_eos)
            else:
                runs: dict[str, list[GenerationResult]] = {m: [] for m in modes}
                walls = dict.fromkeys(modes, 0.0)
                rates: dict[str, list[float]] = {m: [] for m in modes}
                for r in range(repeat):
                    for mode in modes:
                        log(f"[bench] {mode} c={c}: {len(prompts)} prompts, run {r + 1} of {repeat}")
                        rs, wall = _run_batch(client, prompts, mode, max_new_tokens, c, log, ignore_eos)
                        runs[mode] += rs
                        walls[mode] += wall
                        rates[mode].append(sum(x.stats.generated_tokens for x in rs) / wall)
                        log(f"[bench] {mode} c={c}, run {r + 1} of {repeat}: {rates[mode][-1]:.1f} tok/s")
                entries = {mode: {**_aggregate(runs[mode], walls[mode]), "runs_tokens_per_s": rates[mode]}
                           for mode in modes}
            for mode in modes:
                entry = entries[mode]
                results[mode][str(c)] = entry
                log(f"[bench] {mode} c={c}: {entry['generated_tokens']} tokens in {entry['wall_s']:.2f} s, "
                    f"{entry['tokens_per_s']:.1f} tok/s, acceptance length {entry['acceptance_length']:.2f}"
                    + _round_costs(entry))

    result = {"command": list(command if command is not None else sys.argv), "machine": machine_info(),
              "config": config, "results": results, "lossless": _lossless(results, concurrency)}
    if baselines:
        result["baselines"] = {}
    for name in baselines:
        log(f"[bench] baseline {name} (after the modes): {len(prompts)} prompts")
        base = bracketed(baseline_before[name], BASELINES[name](prompts, max_new_tokens, ignore_eos, target_model))
        if AR in results:  # how many prompts gave exactly our AR output (a quantized engine may differ)
            ours = results[AR][str(concurrency[0])]["outputs"]
            base["same_as_ar"] = sum(a == b for a, b in zip(base["outputs"], ours, strict=True))
        result["baselines"][name] = base
        log(f"[bench] baseline {name}: {base['generated_tokens']} tokens in {base['wall_s']:.2f} s, "
            f"{base['tokens_per_s']:.1f} tok/s")
    return result


def bracketed(before: dict, after: dict) -> dict:
    """A baseline run before and after the modes as one entry: tokens and seconds summed, each run's tok/s kept."""
    tokens, wall = before["generated_tokens"] + after["generated_tokens"], before["wall_s"] + after["wall_s"]
    return {**after, "generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "runs_tokens_per_s": [before["tokens_per_s"], after["tokens_per_s"]],
            "same_in_both_runs": before["outputs"] == after["outputs"]}


def child_baseline(module: str, extra: list[str], prompts: list[dict], max_new_tokens: int, ignore_eos: bool,
                   target_model: str | None) -> dict:
    """Another engine's greedy AR on the same model and prompts (`python -m dspark_grpc.bench.MODULE`),
    run as a child process so that the bench itself stays torch-free; its JSON on stdout."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.json"
        path.write_text(json.dumps(prompts))
        cmd = [sys.executable, "-m", f"dspark_grpc.bench.{module}", "--prompts-json", str(path),
               "--max-new-tokens", str(max_new_tokens), *extra]
        cmd += (["--ignore-eos"] if ignore_eos else []) + (["--model", target_model] if target_model else [])
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    engine = module.removesuffix("_baseline").replace("_", ".")  # llama.cpp, transformers
    if proc.returncode == -signal.SIGILL:
        raise RuntimeError(f"the {engine} baseline died on an illegal instruction: its build uses instructions this "
                           "CPU or its VM does not grant (AMX, say); `make llama-cpp` builds llama.cpp for this CPU "
                           "without AMX")
    if proc.returncode != 0:
        raise RuntimeError(f"the {engine} baseline exited with {proc.returncode} (its message is above)")
    return json.loads(proc.stdout)


BaselineRun = Callable[[list[dict], int, bool, str | None], dict]
# name -> how it runs: llama.cpp (llama-cpp-python, `make llama-cpp`); HF transformers' generate, eager with its
# dynamic cache, or with its static cache and a compiled forward
BASELINES: dict[str, BaselineRun] = {
    "llama-cpp": functools.partial(child_baseline, "llama_cpp_baseline", []),
    "transformers": functools.partial(child_baseline, "transformers_baseline", []),
    "transformers-compiled": functools.partial(child_baseline, "transformers_baseline", ["--compiled"]),
}


def _check_args(prompts: list[dict], modes: list[str], max_new_tokens: int, concurrency: list[int]) -> None:
    if not prompts:
        raise ValueError("no prompts")
    if not modes or len(set(modes)) != len(modes):
        raise ValueError(f"modes must be distinct, got {modes}")
    for m in modes:
        parse_mode(m)
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if not concurrency or any(c <= 0 for c in concurrency):
        raise ValueError(f"concurrency levels must be positive, got {concurrency}")


def _request(client: TargetClient, prompt: dict, mode: str, max_new_tokens: int,
             ignore_eos: bool = False) -> GenerationResult:
    name, overrides = parse_mode(mode)
    return client.generate(**prompt, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos, mode=name,
                           **overrides)


def _run_interleaved(client: TargetClient, prompts: list[dict], modes: list[str], max_new_tokens: int,
                     log: Callable[[str], None], ignore_eos: bool = False) -> dict[str, dict]:
    """Concurrency 1: each prompt in every mode before the next prompt; a mode's wall time is the sum of its
    requests' times."""
    runs: dict[str, list[GenerationResult]] = {m: [] for m in modes}
    walls = dict.fromkeys(modes, 0.0)
    for i, prompt in enumerate(prompts):
        for mode in modes:
            t0 = time.perf_counter()
            r = _request(client, prompt, mode, max_new_tokens, ignore_eos)
            walls[mode] += time.perf_counter() - t0
            runs[mode].append(r)
            log(f"  [{mode} c=1] {i + 1}/{len(prompts)}: {r.stats.generated_tokens} tokens, {r.stats.steps} steps, "
                f"{r.finish_reason}")
    return {mode: _aggregate(runs[mode], walls[mode]) for mode in modes}


def _run_batch(client: TargetClient, prompts: list[dict], mode: str, max_new_tokens: int, c: int,
               log: Callable[[str], None], ignore_eos: bool = False) -> tuple[list[GenerationResult], float]:
    """All prompts with c requests in flight: their results and the wall time."""
    done = [0]
    lock = threading.Lock()

    def one(prompt: dict) -> GenerationResult:
        r = _request(client, prompt, mode, max_new_tokens, ignore_eos)
        with lock:
            done[0] += 1
            log(f"  [{mode} c={c}] {done[0]}/{len(prompts)}: {r.stats.generated_tokens} tokens, "
                f"{r.stats.steps} steps, {r.finish_reason}")
        return r

    with ThreadPoolExecutor(max_workers=c) as pool:
        t0 = time.perf_counter()
        rs = list(pool.map(one, prompts))
        wall = time.perf_counter() - t0
    return rs, wall


def _round_costs(entry: dict) -> str:
    """'; drafter round X ms (in the draft service Y, of which proposals Z), the steps waited W ms per speculative
    step' where the mode drafted."""
    steps, rounds = entry.get("speculative_steps", 0), entry.get("draft_rounds", 0)
    if not steps:
        return ""
    per_round = lambda key: 1e3 * entry.get(key, 0.0) / rounds if rounds else 0.0  # noqa: E731
    return (f"; drafter round {per_round('draft_round_s'):.1f} ms (in the draft service "
            f"{per_round('draft_service_s'):.1f}, of which proposals {per_round('draft_compute_s'):.1f}), the steps "
            f"waited {1e3 * entry['draft_s'] / steps:.1f} ms per speculative step")


def _aggregate(rs: list[GenerationResult], wall: float) -> dict:
    stats = [r.stats for r in rs]
    generated = sum(s.generated_tokens for s in stats)
    steps = sum(s.steps for s in stats)
    return {
        "tokens_per_s": generated / wall,
        "acceptance_length": sum(max(s.generated_tokens - 1, 0) for s in stats) / steps if steps else 0.0,
        "per_position_acceptance": per_position_acceptance(stats),
        "outputs": [r.token_ids for r in rs],
        "fallbacks": [s.fallback_reason for s in stats if s.fallback_reason],
        "wall_s": wall,
        "generated_tokens": generated,
        "steps": steps,
        "speculative_steps": sum(s.speculative_steps for s in stats),
        "finish_reasons": [r.finish_reason for r in rs],
        "prefill_s": sum(s.prefill_seconds for s in stats),
        "draft_s": sum(s.draft_seconds for s in stats),
        # the steps that asked the drafter within the step (not drafted ahead): their wait and, of it, the draft
        # service's own time on the proposals
        "draft_rounds": sum(s.draft_rounds for s in stats),
        "draft_round_s": sum(s.draft_round_seconds for s in stats),
        "draft_service_s": sum(s.draft_service_seconds for s in stats),
        "draft_compute_s": sum(s.draft_compute_seconds for s in stats),
        "verify_s": sum(s.verify_seconds for s in stats),
        # how the steps batched: sessions and rows per target forward, sessions per drafter pass (step-weighted)
        "forward_sessions": _per_step(stats, "forward_sessions"),
        "forward_rows": _per_step(stats, "forward_rows"),
        "draft_pass_sessions": _weighted(stats, "draft_pass_sessions", "speculative_steps"),
        # what crossed the client per step (session ops), and how much of it was hidden states
        "client_bytes_per_step": sum(s.session_bytes for s in stats) / steps if steps else 0.0,
        "client_capture_bytes_per_step": sum(s.capture_bytes for s in stats) / steps if steps else 0.0,
        "draft_ahead_hit_rate": (sum(s.drafts_ready for s in stats) / sum(s.speculative_steps for s in stats)
                                 if any(s.speculative_steps for s in stats) else 0.0),
        "from_chain_rate": (sum(s.drafts_from_chain for s in stats) / sum(s.speculative_steps for s in stats)
                            if any(s.speculative_steps for s in stats) else 0.0),
        "from_lookup_rate": (sum(s.drafts_from_lookup for s in stats) / sum(s.speculative_steps for s in stats)
                             if any(s.speculative_steps for s in stats) else 0.0),
    }


def _per_step(stats: list, name: str) -> float:
    return _weighted(stats, name, "steps")


def _weighted(stats: list, name: str, weight: str) -> float:
    """The mean of a per-request mean, weighted by each request's count of what it averages over."""
    total = sum(getattr(s, weight) for s in stats)
    return sum(getattr(s, name) * getattr(s, weight) for s in stats) / total if total else 0.0


def per_position_acceptance(stats: list) -> list[float]:
    """Pooled accepted/drafted per depth over all requests."""
    depth = max((len(s.drafted_per_position) for s in stats), default=0)
    drafted, accepted = [0] * depth, [0] * depth
    for s in stats:
        for d, (n, a) in enumerate(zip(s.drafted_per_position, s.accepted_per_position, strict=True)):
            drafted[d] += n
            accepted[d] += a
    return [a / n if n else 0.0 for a, n in zip(accepted, drafted, strict=True)]


def _lossless(results: dict[str, dict[str, dict]], concurrency: list[int]) -> dict[str, bool]:
    """Each mode's outputs == AR's at every concurrency; AR's own entry: the same at every concurrency."""
    if AR not in results:
        return {}
    ar = results[AR]
    first = ar[str(concurrency[0])]["outputs"]
    # with --repeat an entry holds its prompts' outputs once per repeat
    lossless = {AR: all(ar[str(c)]["outputs"] == first * (len(ar[str(c)]["outputs"]) // len(first))
                          for c in concurrency)}
    for mode, by_c in results.items():
        if mode != AR:
            lossless[mode] = all(by_c[str(c)]["outputs"] == ar[str(c)]["outputs"] for c in concurrency)
    return lossless


def format_table(result: dict) -> str:
    """mode, concurrency, tok/s, ratio vs AR (same concurrency), acceptance length, lossless."""
    rows = [f"{'mode':<12} {'conc':>4} {'tok/s':>8} {'vs AR':>6} {'acc.len':>7} {'wall s':>7}  lossless"]
    results, lossless = result["results"], result["lossless"]
    for c in result["config"]["concurrency"]:
        ar = results.get(AR, {}).get(str(c))
        for mode, by_c in results.items():
            e = by_c[str(c)]
            ratio = f"{e['tokens_per_s'] / ar['tokens_per_s']:.2f}" if ar and ar["tokens_per_s"] else "-"
            same = {True: "yes", False: "NO"}.get(lossless.get(mode), "-")
            rows.append(f"{mode:<12} {c:>4} {e['tokens_per_s']:>8.1f} {ratio:>6} {e['acceptance_length']:>7.2f} "
                        f"{e['wall_s']:>7.2f}  {same}")
    ar = results.get(AR, {}).get(str(result["config"]["concurrency"][0]))
    for name, base in result.get("baselines", {}).items():
        ratio = f"{base['tokens_per_s'] / ar['tokens_per_s']:.2f}" if ar and ar["tokens_per_s"] else "-"
        same = f"{base['same_as_ar']}/{len(base['outputs'])} same" if "same_as_ar" in base else "-"
        rows.append(f"{name + ' (AR)':<12} {1:>4} {base['tokens_per_s']:>8.1f} {ratio:>6} {1.0:>7.2f} "
                    f"{base['wall_s']:>7.2f}  {same}")
    return "\n".join(rows)


