"""Text <-> token ids: byte-level BPE or SentencePiece BPE from GGUF metadata, or a HF tokenizer directory, and chat
templates."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")

# The turn format of a family whose GGUFs often come without tokenizer.chat_template (llama.cpp then recognises the
# family by its tokens, Ollama ships the template beside the file): Gemma's, as its instruction-tuned models are
# trained on (a system message opens the first user turn; the assistant's role is "model").
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{{ (first if loop.first else '') + (m['content'] | trim) + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
CHAT_TEMPLATE_OF_ARCHITECTURE = {"gemma3": GEMMA_CHAT_TEMPLATE}

_LETTERS_THEN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_PUNCT_AND_SPACE = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = _LETTERS_THEN + r"\p{N}" + _PUNCT_AND_SPACE
LLAMA3_SPLIT = _LETTERS_THEN + r"\p{N}{1,3}" + _PUNCT_AND_SPACE
_REGEX_PRE = {
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
}
SUPPORTED_PRE = ("smollm", "gpt-2", *_REGEX_PRE)


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in _REGEX_PRE:
        split = pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level])
    raise ValueError(
        f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre), supported: {SUPPORTED_PRE}"
    )


def _sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], unk: str,
                       add_space_prefix: bool) -> Tokenizer:
    """SentencePiece's BPE (llama.cpp's "llama" vocabulary) as a `tokenizers` BPE: spaces are '▁', the text is not
    split first, and of the adjacent pieces whose concatenation is a normal token the pair making the best-scored
    token merges first; a character outside the vocabulary becomes its UTF-8 bytes' <0xNN> tokens. The file has no
    merge list: every split of every normal token into two tokens is one, ranked by the token's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, score, kind in zip(tokens, scores, types, strict=True):
        if kind != NORMAL:
            continue
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[token], vocab[left], left, right))
    ranked.sort()
    bpe = models.BPE(vocab=vocab, merges=[(left, right) for *_, left, right in ranked], unk_token=unk,
                     fuse_unk=True, byte_fallback=True)
    tk = Tokenizer(bpe)
    space = [normalizers.Replace(" ", "\u2581")]
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), *space] if add_space_prefix else space)
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tk


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class TextTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        extra_eos_ids: Sequence[int] = (),
    ):
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id: int | None = tokenizer.token_to_id(bos_token) if bos_token is not None else None
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        specials = self.special_token_ids()
        end_of_turn = [i for i in map(tokenizer.token_to_id, END_OF_TURN_TOKENS) if i in specials]
        eos = [
            tokenizer.token_to_id(eos_token) if eos_token is not None else None,
            *extra_eos_ids,
            *end_of_turn,
        ]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> TextTokenizer:
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types = meta.get("tokenizer.ggml.token_type") or []
        if kind == "gpt2":
            pre = meta.get("tokenizer.ggml.pre", "gpt-2")
            merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
            bpe = models.BPE(
                vocab={t: i for i, t in enumerate(tokens)},
                merges=merges,
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=pre in ("llama-bpe", "llama3"),
            )
            tk = Tokenizer(bpe)
            tk.pre_tokenizer = _byte_level_pre_tokenizer(pre)
            tk.decoder = decoders.ByteLevel()
        elif kind == "llama" and "tokenizer.ggml.merges" not in meta:
            unk = tokens[meta.get("tokenizer.ggml.unknown_token_id", 0)]
            tk = _sentencepiece_bpe(tokens, meta["tokenizer.ggml.scores"], types, unk,
                                    bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r}: byte-level BPE ('gpt2') and SentencePiece "
                             "BPE ('llama', scores without merges) are supported")
        typed = list(zip(tokens, types, strict=False))
        tk.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in typed if ty == CONTROL]
        )
        tk.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, ty in typed if ty == USER_DEFINED]
        )

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        return cls(
            tk,
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            chat_template=meta.get("tokenizer.chat_template")
            or CHAT_TEMPLATE_OF_ARCHITECTURE.get(meta.get("general.architecture", "")),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            extra_eos_ids=extra,
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> TextTokenizer:
        from dspark_grpc.runtime.formats.gguf_reader import open_gguf, read_gguf_metadata

        return cls.from_gguf_metadata(read_gguf_metadata(open_gguf(path)))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> TextTokenizer:
        tk = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config: dict[str, Any] = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        bos, eos = _token_str(config.get("bos_token")), _token_str(config.get("eos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            bos_id = tk.token_to_id(bos) if bos is not None else None
            add_bos = bos_id is not None and tk.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
        extra: list[int] = []
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                gen_eos = json.load(f).get("eos_token_id")
            extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        return cls(
            tk,
            bos_token=bos,
            eos_token=eos,
            chat_template=template,
            add_bos_token=add_bos,
            extra_eos_ids=extra,
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; pass a raw prompt instead")
        return compile_chat_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **variables,
        )

    def fingerprint(self) -> str:
        """Same value for the same token <-> id mapping, wherever the tokenizer was loaded from."""
        model = json.loads(self.tokenizer.to_str())["model"]
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        h = hashlib.sha256()
        h.update(json.dumps(sorted(vocab, key=vocab.__getitem__), ensure_ascii=False).encode())
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        h.update(json.dumps(merges, ensure_ascii=False).encode())
        h.update(json.dumps(sorted(self.special_token_ids())).encode())
        return h.hexdigest()

    def save(self, directory: str | os.PathLike[str]) -> None:
        """tokenizer.json + tokenizer_config.json, loadable by `from_hf_dir` and by HF's AutoTokenizer."""
        os.makedirs(directory, exist_ok=True)
        tk = Tokenizer.from_str(self.tokenizer.to_str())
        if self.add_bos_token:
            bos = (self.bos_token, self.bos_token_id)
            tk.post_processor = processors.TemplateProcessing(
                single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
            )
        tk.save(os.path.join(directory, "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)
