"""docs/ARCHITECTURE.md traces one speculative step through files, classes and functions by name: every name it
gives must exist in the code, so that the doc cannot drift from it unnoticed. Checked from the source (ast and
text), not by importing it, in about a second.

What counts as a citation (everything else is prose and is not checked):

- Paths. A backticked `dir/file.ext`, a plain dir/file.ext token in the text (fenced blocks included) and the target
  of a relative Markdown link, for the extensions in EXTENSIONS, must exist from the repository root or from docs/
  (`../tests/x.py`). A backticked `dir/` must be a folder. A backticked bare `file.py` must exist under the folder
  that opens its list item (``- `speculation/`: `generation.py`, ...``), else anywhere in the repository. Skipped:
  globs (`*`), home or variable paths (`~/`, `$X/`), URLs. Anchors of links are test_docs.py's job.
- `path.py:name`, `path.py: name` and `path.py:Class.member`: the file exists and defines the name (below); in a
  .cpp or .proto file the name occurs in its text.
- Code symbols, backticked, a trailing call `(...)` dropped. `Class.member` (the first part capitalised) needs a class
  of that name that defines the member, or a proto message, enum or service of that name with the member in its
  block. `CamelCase`, `snake_case` and single lower-case words (`handle`, `receive`) need a definition in some
  Python file, or a module or folder of that name (`dspark_grpc`, `speculation`), or the name in a .proto or .cpp
  file (messages, fields, intrinsics), or the name as a string literal of the sources outside tests/ (what the code
  reads or names: HF class and config keys, mode names such as `fast` or `hybrid`). `ALL_CAPS` (environment
  variables, constants, quant types; `=value` dropped) must occur in a source or config file of the repository
  other than a Markdown one. `dspark_grpc.pkg.module[.name]` must resolve in the tree, and so
  must `module.name` where module.py is one of ours and its name has an underscore (`fixed_rows.off()`; a plain
  word such as `loop.` is usually a variable). Skipped: CLI flags (`--x`), anything with a space or a hyphen
  (commands, thread names), other dotted names (asyncio's, gguf keys).

The repository is searched without this file (its synthetic doc names what does not exist). Defined means, in a .py
file outside .venv and caches: `def name`, `class name`, or an assignment `name = ...` / `name: T` / `x.name = ...`
at any indentation. A class's members are the functions, classes and names assigned in its body, the attributes its
methods assign to self, and its bases' members (bases found by name).
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
EXTENSIONS = ("py", "pyi", "cpp", "proto", "md", "toml", "yml", "yaml", "jsonl", "json", "sh", "txt")
SKIP_DIRS = {".git", ".venv", ".cache", ".ruff_cache", ".pytest_cache", "__pycache__", "dspark_grpc.egg-info"}
TEXT_SUFFIXES = {".py", ".pyi", ".proto", ".cpp", ".toml", ".yml", ".yaml", ".sh", ".cfg"}  # for ALL_CAPS words
TEXT_NAMES = {"Makefile", "Dockerfile"}
EXT = "|".join(EXTENSIONS)
PATH_TOKEN = rf"(?:\.\.?/)?[\w.-]+(?:/[\w.-]+)*\.(?:{EXT})"
CODE_PATH = re.compile(rf"({PATH_TOKEN})(?::\s*([\w.]+))?")  # the whole of a backticked span
CODE_DIR = re.compile(r"(?:\.\./)?[\w.-]+(?:/[\w.-]+)*/")
PLAIN_PATH = re.compile(rf"(?<![\w/.$~`-])((?:\.\./)?[A-Za-z_][\w.-]*(?:/[\w.-]+)+\.(?:{EXT}))(?![\w/])")
PLAIN_DIR = re.compile(r"(?<![\w/.$~`-])((?:\.\./)?[a-z_][\w-]*(?:/[a-z_][\w-]*)*/)(?=[\s,.;:)]|$)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
ITEM = re.compile(r"^(\s*)(?:[-*]|\d+\.)\s+")
ALL_CAPS = re.compile(r"[A-Z][A-Z0-9_]+")
CAMEL = re.compile(r"_?[A-Z]\w*[a-z]\w*")
SNAKE = re.compile(r"_\w+|[a-z][a-z0-9]*(?:_\w+)?")  # snake_case, _private, or one lower-case word
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+")


@dataclass
class Module:
    names: set[str] = field(default_factory=set)  # defined at any indentation
    classes: dict[str, tuple[set[str], list[str]]] = field(default_factory=dict)  # members, base names


@dataclass
class Repo:
    files: set[str]  # posix paths from the root
    dirs: set[str]
    stems: set[str]  # module and folder names
    modules: dict[str, Module]  # .py files by path
    classes: dict[str, list[tuple[set[str], list[str]]]]
    names: set[str]  # defined in some .py file
    strings: set[str]  # string literals of the sources outside tests/
    proto_blocks: dict[str, str]  # message, enum or service name -> its block
    foreign_words: set[str]  # every word of the .proto files (comments left out) and the .cpp files
    words: set[str]  # every word of the non-Markdown sources and configs


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [t for target in node.targets for t in ast.walk(target)]
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    return []


def _scan(tree: ast.Module) -> tuple[Module, set[str]]:
    """A file's definitions and its identifier-like string literals, in one pass over its tree."""
    module, strings = Module(), set()
    defs = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    stack: list[tuple[ast.AST, set[str] | None]] = [(tree, None)]  # a node, the members of the class it is in
    while stack:
        node, members = stack.pop()
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str) and node.value.isidentifier():
                strings.add(node.value)
            continue
        if isinstance(node, defs):
            module.names.add(node.name)
        for t in _targets(node):
            if isinstance(t, ast.Name):
                module.names.add(t.id)
            elif isinstance(t, ast.Attribute):
                module.names.add(t.attr)
                if members is not None and isinstance(t.value, ast.Name) and t.value.id == "self":
                    members.add(t.attr)
        if isinstance(node, ast.ClassDef):
            members = {n.name for n in node.body if isinstance(n, defs)}
            members |= {t.id for n in node.body for t in _targets(n) if isinstance(t, ast.Name)}
            bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                     if isinstance(b, ast.Name | ast.Attribute)]
            module.classes[node.name] = (members, bases)
        stack.extend((child, members) for child in ast.iter_child_nodes(node))
    return module, strings


@cache
def repo() -> Repo:
    files, dirs, modules, strings, words = set(), set(), {}, set(), set()
    proto_text, foreign_words = "", set()
    for top, subdirs, names in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS]
        rel_top = Path(top).relative_to(ROOT)
        dirs.update((rel_top / d).as_posix() for d in subdirs)
        for name in names:
            path, rel = Path(top) / name, (rel_top / name).as_posix()
            files.add(rel)
            if path == Path(__file__):  # its synthetic doc's missing names are in its text
                continue
            if path.suffix in TEXT_SUFFIXES or name in TEXT_NAMES:
                text = path.read_text(errors="replace")
                words.update(re.findall(r"\w+", text))
                if path.suffix == ".cpp":  # comments too: the instructions they name (`vdpbf16ps`)
                    foreign_words.update(re.findall(r"\w+", text))
                elif path.suffix == ".proto":
                    proto_text += re.sub(r"//[^\n]*", "", text) + "\n"
                elif path.suffix == ".py":
                    modules[rel], literals = _scan(ast.parse(text))
                    if not rel.startswith("tests/"):
                        strings |= literals
    classes: dict[str, list[tuple[set[str], list[str]]]] = {}
    for module in modules.values():
        for name, cls in module.classes.items():
            classes.setdefault(name, []).append(cls)
    blocks = {}
    for m in re.finditer(r"\b(?:message|enum|service)\s+(\w+)\s*\{", proto_text):
        depth, i = 1, m.end()
        while depth and i < len(proto_text):
            depth += {"{": 1, "}": -1}.get(proto_text[i], 0)
            i += 1
        blocks[m.group(1)] = proto_text[m.end():i]
    foreign_words.update(re.findall(r"\w+", proto_text))
    names = set().union(*(m.names for m in modules.values()))
    stems = {p.rsplit("/", 1)[-1].removesuffix(".py") for p in files | dirs}
    return Repo(files, dirs, stems, modules, classes, names, strings, blocks, foreign_words, words)


def has_member(cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    """Some class of that name, or one of its bases, defines the member."""
    return any(member in members or any(has_member(b, member, seen | {cls}) for b in bases if b not in seen)
               for members, bases in repo().classes.get(cls, []))


def _norm(path: str) -> str:
    return os.path.normpath(path).replace(os.sep, "/")


def find_files(name: str, doc_dir: Path, folder: str | None = None) -> list[str]:
    """The repository files a cited path means: from the root or the doc's folder; a bare name under the item's
    folder, or anywhere."""
    r = repo()
    if "/" in name:
        rel_doc = _norm((doc_dir.relative_to(ROOT) / name).as_posix())
        return [p for p in (_norm(name), rel_doc) if p in r.files]
    if folder:
        return sorted(p for p in r.files if p.startswith(folder) and p.rsplit("/", 1)[-1] == name)
    return sorted(p for p in r.files if p.rsplit("/", 1)[-1] == name)


def is_dir(name: str, doc_dir: Path) -> bool:
    r = repo()
    return _norm(name) in r.dirs or _norm((doc_dir.relative_to(ROOT) / name).as_posix()) in r.dirs


def defined_in(path: str, dotted: str) -> bool:
    """`name` or `Class.member` is defined in the file (a .py file's definitions, another file's text)."""
    if not path.endswith(".py"):
        return re.search(rf"\b{re.escape(dotted.split('.')[-1])}\b", (ROOT / path).read_text()) is not None
    module = repo().modules.get(path)
    if module is None:
        return False
    head, *rest = dotted.split(".")
    if not rest:
        return head in module.names
    return head in module.classes and has_member(head, rest[0])


def symbol_missing(code: str) -> str | None:
    """The name a backticked span cites that the code does not have, or None (found, or not a code symbol)."""
    r = repo()
    code = re.sub(r"\(.*\)$", "", code.lstrip("$")).split("=")[0]
    if code.startswith("-") or not code or not re.fullmatch(r"[\w.]+", code):
        return None
    if ALL_CAPS.fullmatch(code):
        return None if code in r.words else code
    if DOTTED.fullmatch(code):
        head, member, *_ = code.split(".")
        if head[0].isupper():
            if head in r.classes:
                return None if has_member(head, member) else code
            if head in r.proto_blocks:
                return None if re.search(rf"\b{member}\b", r.proto_blocks[head]) else code
            return code
        if head == "dspark_grpc":  # dspark_grpc.pkg.module: the package's folder in this tree
            parts = code.split(".")[1:]
            for i in range(len(parts), 0, -1):
                stem = "/".join(parts[:i])
                path = next((p for p in (f"{stem}.py", f"{stem}/__init__.py") if p in r.files), None)
                if path:
                    return None if i == len(parts) or defined_in(path, parts[i]) else code
            return code
        paths = [p for p in r.modules if p.rsplit("/", 1)[-1] == f"{head}.py"] if "_" in head.strip("_") else []
        if paths and not any(defined_in(p, member) for p in paths):
            return code
        return None
    if CAMEL.fullmatch(code) or SNAKE.fullmatch(code):
        found = code in r.names or code in r.stems or code in r.foreign_words or code in r.strings
        return None if found else code
    return None


def _blank(text: str, pattern: re.Pattern[str]) -> str:
    """The text with each match of the pattern turned to spaces (its newlines kept, so line numbers hold)."""
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _folders(text: str) -> list[str | None]:
    """Per line: the folder that opens the list item the line is in (``- `runtime/models/`: ...``), or None."""
    out: list[str | None] = []
    folder, indent = None, -1
    for line in text.split("\n"):
        item = ITEM.match(line)
        if item:
            indent = len(item.group(1))
            m = re.match(r"`((?:[\w.-]+/)+)`", line[item.end():])
            folder = m.group(1) if m else None
        elif not line.strip() or len(line) - len(line.lstrip()) <= indent:
            folder, indent = None, -1
        out.append(folder)
    return out


def check(text: str, doc_dir: Path = DOC.parent) -> list[str]:
    """Every citation of the doc's text that the repository does not have, as 'line N: what (why)'."""
    problems: list[tuple[int, str]] = []

    def line(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    folders = _folders(text)
    prose = _blank(text, FENCE)
    for m in SPAN.finditer(prose):
        code = re.sub(r"\s+", " ", m.group(1)).strip()
        n = line(m.start())
        if "*" in code or ("/" in code and code.startswith(("~", "$", "/", "-"))):  # a glob, a path not ours
            continue
        path = CODE_PATH.fullmatch(code)
        if path:
            name, symbol = path.groups()
            found = find_files(name, doc_dir, folders[n - 1])
            if not found:
                problems.append((n, f"`{name}` (no such file)"))
            elif symbol and not any(defined_in(p, symbol) for p in found):
                problems.append((n, f"`{name}:{symbol}` (not defined there)"))
        elif CODE_DIR.fullmatch(code):
            if not is_dir(code, doc_dir):
                problems.append((n, f"`{code}` (no such folder)"))
        elif " " not in code:
            missing = symbol_missing(code)
            if missing:
                problems.append((n, f"`{missing}` (not defined in the code)"))
    for m in LINK.finditer(prose):
        target = m.group(1).partition("#")[0]
        if target and not re.match(r"[a-z]+:", target) and not (doc_dir / target).exists():
            problems.append((line(m.start()), f"link to {target} (no such file)"))
    cited = [m.span() for m in SPAN.finditer(prose)] + [m.span(1) for m in LINK.finditer(prose)]
    chars = list(text)
    for a, b in cited:
        chars[a:b] = re.sub(r"[^\n]", " ", text[a:b])
    plain = "".join(chars)
    for m in PLAIN_PATH.finditer(plain):
        if not find_files(m.group(1), doc_dir):
            problems.append((line(m.start()), f"{m.group(1)} (no such file)"))
    for m in PLAIN_DIR.finditer(plain):
        if not is_dir(m.group(1), doc_dir):
            problems.append((line(m.start()), f"{m.group(1)} (no such folder)"))
    return [f"line {n}: {what}" for n, what in sorted(set(problems))]


def test_every_file_and_name_the_architecture_names_exists():
    problems = check(DOC.read_text())
    assert not problems, "docs/ARCHITECTURE.md cites what the repository does not have:\n" + "\n".join(problems)


def test_the_check_reports_a_missing_file_and_function_and_passes_existing_ones():
    doc = "\n".join([
        "# Synthetic",
        "The step: `target_service/step_engine.py:StepEngine._run_step` and `StepEngine.step`;",  # 2: exist
        "`target_service/no_such_file.py` is gone, and so is `target_service/step_engine.py:",  # 3
        "   _no_such_function` and `StepEngine._no_such_step` and `_no_such_helper`.",  # 4
        "- `speculation/`: `channel.py`, `steps.py`",  # 5: steps.py moved to target_service/
        "",
        "Plain paths: serving/batching.py exists, serving/gone.py does not; [layers](../tests/test_layers.py),",
        "[gone](../tests/test_gone.py). `DSPARK_COST_CACHE`, `NO_SUCH_VARIABLE_XYZ`, `OpenDraft.session_id`,",
        "`OpenDraft.no_such_field`, `--threads`, `hybrid`, `runtime/models/`, `runtime/no_such_room/`, `receive`.",
    ])
    problems = check(doc)
    assert problems == [
        "line 3: `target_service/no_such_file.py` (no such file)",
        "line 3: `target_service/step_engine.py:_no_such_function` (not defined there)",
        "line 4: `StepEngine._no_such_step` (not defined in the code)",
        "line 4: `_no_such_helper` (not defined in the code)",
        "line 5: `steps.py` (no such file)",
        "line 7: serving/gone.py (no such file)",
        "line 8: `NO_SUCH_VARIABLE_XYZ` (not defined in the code)",
        "line 8: link to ../tests/test_gone.py (no such file)",
        "line 9: `OpenDraft.no_such_field` (not defined in the code)",
        "line 9: `receive` (not defined in the code)",
        "line 9: `runtime/no_such_room/` (no such folder)",
    ], problems
