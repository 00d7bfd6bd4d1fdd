"""What every command-line tool of the project shares (torch-free): one-line errors and the service entry points.

An ordinary mistake (a bad flag value, a service that is not running, a missing dependency) prints one line on
stderr that says what was wrong and what to do, and exits non-zero; never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import NoReturn

CHAT_ROLES = ("system", "user", "assistant", "tool")
SERVER_PACKAGES = ("torch", "numpy", "safetensors", "gguf", "tokenizers")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: `prog: error: what (see prog --help)`, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(prog: str, message: str, code: int = 1) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(float, text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = _number(float, text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def chat_messages(text: str) -> list[dict[str, str]]:
    """`--messages`: a JSON list of {"role": ..., "content": ...} with a known role."""
    example = '[{"role": "user", "content": "Hi"}]'
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at character {e.pos}); expected e.g. {example}") \
            from None
    if not isinstance(messages, list) or not messages:
        raise argparse.ArgumentTypeError(f"expected a non-empty JSON list of messages, e.g. {example}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"} or not all(isinstance(v, str) for v in m.values()):
            raise argparse.ArgumentTypeError(f"message {i} must be an object with string fields role and content "
                                             f"only, e.g. {example}")
        if m["role"] not in CHAT_ROLES:
            raise argparse.ArgumentTypeError(f"message {i} has role {m['role']!r}; roles are {', '.join(CHAT_ROLES)}")
    return messages


def _service_main(prog: str, module: str) -> None:
    for package in SERVER_PACKAGES:
        try:
            importlib.import_module(package)
        except ImportError:
            fail(prog, f"needs the service dependencies ({package} is not installed): "
                       "pip install 'dspark-grpc[server]' (the SDK alone is `pip install dspark-grpc`)")
    sys.exit(importlib.import_module(module).main())


def target_main() -> None:
    _service_main("dspark-target", "dspark_grpc.target_service.cli")


def draft_main() -> None:
    _service_main("dspark-draft", "dspark_grpc.draft_service.cli")


def convert_main() -> None:
    _service_main("dspark-convert", "dspark_grpc.runtime.drafter_formats")


def train_main() -> None:
    _service_main("dspark-train", "dspark_grpc.runtime.train.cli")
