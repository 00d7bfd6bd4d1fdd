"""What every command-line tool of the project shares (torch-free): one-line errors and the entry points.

An ordinary mistake (a bad flag value, a service that is not running, a missing dependency) prints one line on
stderr that says what was wrong and what to do, and exits non-zero; never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import re
import sys
from typing import NoReturn

CHAT_ROLES = ("system", "user", "assistant", "tool")
SERVER_PACKAGES = ("torch", "numpy", "safetensors", "gguf", "tokenizers", "grpc_reflection")
# The package is not on PyPI: it installs from a checkout (or a wheel built there with `pip wheel --no-deps .`).
INSTALL_SERVER = ("in a dspark-grpc checkout, pip install '.[server]' (a built wheel: pip install 'WHEEL[server]'; "
                  "the SDK alone: pip install .)")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, unless that says nothing or the wrong thing: a flag (store_true or
    store_false: its help says what it changes), no value (None), an empty list, or help that names its default."""

    _NAMES_DEFAULT = re.compile(r"\bdefault\b\s*[:=]|\bby default\b|%\(default\)", re.IGNORECASE)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default in (None, [], "") or self._NAMES_DEFAULT.search(action.help or ""):
            return action.help
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: `prog: error: what (see prog --help)`, exit 2; --help shows the
    defaults (DefaultsHelpFormatter), in its sub-commands' parsers too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(prog: str, message: str, code: int = 1) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def port_number(text: str) -> int:
    value = _number(int, text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0 picks a free one), got {text}")
    return value


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


def device_choice(text: str) -> str:
    """`--device`: auto, cpu, cuda or cuda:N (whether that CUDA device exists is checked where torch is loaded:
    runtime/kernels/device.py)."""
    value = text.strip().lower()
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


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


def _service_main(prog: str, module: str, about: str) -> None:
    """Runs `module`'s main() where the service dependencies are installed; where they are not (an SDK-only install),
    --help says what the tool is and what to install (exit 0), anything else is one line saying so (exit 1)."""
    for package in SERVER_PACKAGES:
        try:
            importlib.import_module(package)
        except ImportError:
            if any(a in ("-h", "--help") for a in sys.argv[1:]):
                print(_without_server_help(prog, about, package))
                sys.exit(0)
            fail(prog, f"needs the service dependencies ({package} is not installed): {INSTALL_SERVER}")
    sys.exit(importlib.import_module(module).main())


def _without_server_help(prog: str, about: str, missing: str) -> str:
    try:
        version = importlib.metadata.version("dspark-grpc")
    except importlib.metadata.PackageNotFoundError:
        version = "VERSION"
    return (f"usage: {prog} ...\n\n{about}.\n\n"
            f"This install lacks the service dependencies ({missing} is not installed). In a dspark-grpc checkout:\n"
            "  pip install '.[server]'\n"
            "or with a wheel built there (pip wheel --no-deps -w dist .):\n"
            f"  pip install 'dist/dspark_grpc-{version}-py3-none-any.whl[server]'\n"
            f"Then `{prog} --help` lists its commands and options. (The client SDK and `dspark` need only "
            "`pip install .`)")


def dspark_main() -> None:
    """`dspark`: the client's commands (dspark_grpc.client.cli), and `dspark bench`, the bench package's program (a
    tool above the SDK, which never imports it)."""
    if sys.argv[1:2] == ["bench"]:
        importlib.import_module("dspark_grpc.bench.cli").main(sys.argv[2:], command=sys.argv)
    else:
        importlib.import_module("dspark_grpc.client.cli").main()


def target_main() -> None:
    _service_main("dspark-target", "dspark_grpc.target_service.cli", "DSpark target verifier service (gRPC)")


def draft_main() -> None:
    _service_main("dspark-draft", "dspark_grpc.draft_service.cli", "DSpark draft service (gRPC)")


def convert_main() -> None:
    _service_main("dspark-convert", "dspark_grpc.runtime.formats.drafter_formats",
                  "Convert a DFlash/DSpark drafter HF directory to a drafter GGUF")


def train_main() -> None:
    _service_main("dspark-train", "dspark_grpc.train.cli",
                  "Self-distil a DSpark drafter for a target model, end to end")
