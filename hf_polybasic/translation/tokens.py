"""What each token of a tokenizer stands for in the text, as bytes, and how to encode a piece of text
that continues a text (not one that starts it).

Two tokenizers can only be compared through the text their tokens spell. `token_bytes` reads that
from the tokenizer's own decoder settings (a `tokenizers` backend, as every fast tokenizer has):

* byte-level BPE (GPT-2, Qwen, SmolLM2, Llama 3): each character of a token is one byte, through
  GPT-2's byte-to-character table (``Ġ`` is a space, ``Ċ`` a newline);
* SentencePiece-style BPE (``Metaspace``, or ``Replace`` + ``ByteFallback`` as in Llama 2 and
  Gemma): ``▁`` is a space and ``<0xNN>`` tokens are single bytes;
* a tokenizer whose decoder only joins its tokens (``Fuse``, or none): each token spells its string.

Special tokens (control tokens such as EOS or ``<|im_start|>``) spell no text: they are matched by
their content string instead (`hf_polybasic.translation.shared`).

A tokenizer that puts a space before a text (``Metaspace`` with a prepend scheme, a ``Prepend``
normalizer, a ``ByteLevel`` pre-tokenizer with ``add_prefix_space``) would also put one before every
piece of a text encoded on its own; `continuation_encoder` gives a private copy of the tokenizer's
pipeline with that turned off, for pieces in the middle of a text.
"""

from __future__ import annotations

import functools
import json
import re

SPACE_SIGN = "\u2581"  # ▁
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {character: byte for byte, character in bytes_to_unicode().items()}


def backend_spec(tokenizer) -> dict:
    """The text pipeline of a fast tokenizer (its normalizer, pre-tokenizer and decoder, as their JSON;
    a clear error for another kind of tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"hf_polybasic.levels.translated needs fast tokenizers (a `tokenizers` backend), got "
            f"{type(tokenizer).__name__}; load it with AutoTokenizer.from_pretrained(..., use_fast=True)")
    parts = {"normalizer": backend.normalizer, "pre_tokenizer": backend.pre_tokenizer, "decoder": backend.decoder}
    return {name: None if part is None else json.loads(part.__getstate__()) for name, part in parts.items()}


def _steps(component: dict | None, key: str) -> list[dict]:
    """A pipeline component and, for a ``Sequence``, its parts (``key``: the list's name)."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [step for part in component.get(key, []) for step in _steps(part, key)]
    return [component]


def _spelling(spec: dict):
    """A function: token string -> its bytes, by the tokenizer's decoder."""
    decoders = _steps(spec.get("decoder"), "decoders")
    kinds = {step.get("type") for step in decoders}
    if "ByteLevel" in kinds:  # each character one byte: GPT-2's table, read as latin-1 characters
        table = str.maketrans({character: chr(byte) for character, byte in _byte_decoder().items()})

        def spell_bytes(token: str) -> bytes:
            try:
                return token.translate(table).encode("latin-1")
            except UnicodeEncodeError:  # a character outside the table: the token spells its own text
                return token.encode()

        return spell_bytes
    replacements = [(step.get("replacement", SPACE_SIGN), " ") for step in decoders if step.get("type") == "Metaspace"]
    replacements += [(step["pattern"]["String"], step["content"]) for step in decoders
                     if step.get("type") == "Replace" and "String" in step.get("pattern", {})]
    if not replacements and kinds <= {None, "Fuse", "Strip"}:  # decoding only joins the tokens
        return str.encode
    if not replacements:
        raise ValueError(
            f"hf_polybasic.levels.translated reads byte-level BPE, SentencePiece-style (Metaspace) and joining (Fuse) "
            f"tokenizers; this one's decoder is {sorted(k for k in kinds if k) or 'missing'}")
    byte_fallback = "ByteFallback" in kinds

    def spell(token: str) -> bytes:
        if byte_fallback and (match := _BYTE_TOKEN.match(token)):
            return bytes([int(match.group(1), 16)])
        for old, new in replacements:
            token = token.replace(old, new)
        return token.encode()

    return spell


def token_bytes(tokenizer) -> list[bytes | None]:
    """Per id of ``tokenizer`` (``len(tokenizer)`` of them), the bytes it spells in a text; None for
    special tokens (matched by content instead) and for ids without a token."""
    spec = backend_spec(tokenizer)
    spell = _spelling(spec)
    special = {int(i) for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    added = {int(i): token.content for i, token in tokenizer.added_tokens_decoder.items() if not token.special}
    table: list[bytes | None] = [None] * len(tokenizer)
    for token, index in tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False).items():
        if 0 <= index < len(table) and index not in special:
            table[index] = spell(token)
    for index, content in added.items():
        if 0 <= index < len(table):
            table[index] = content.encode()
    return table


def special_contents(tokenizer) -> dict[str, int]:
    """The special tokens of ``tokenizer``: content string -> id."""
    return {token.content: int(i) for i, token in tokenizer.added_tokens_decoder.items() if token.special}


def _without_leading_space(spec: dict) -> tuple[dict, bool]:
    """``spec`` with every step that puts a space before a text turned off; whether there was one."""
    found = False

    def visit(node):
        nonlocal found
        if isinstance(node, dict):
            kind = node.get("type")
            if kind == "Metaspace" and node.get("prepend_scheme", "always") != "never":
                node["prepend_scheme"], found = "never", True
            if kind == "Metaspace" and node.get("add_prefix_space"):  # older releases' spelling
                node["add_prefix_space"], found = False, True
            if kind == "ByteLevel" and node.get("add_prefix_space"):
                node["add_prefix_space"], found = False, True
            for key, value in list(node.items()):
                if isinstance(value, list) and key in ("normalizers", "pretokenizers"):
                    kept = [part for part in value if not (isinstance(part, dict) and part.get("type") == "Prepend")]
                    found = found or len(kept) < len(value)
                    node[key] = kept
                visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    spec = json.loads(json.dumps(spec))
    for key in ("normalizer", "pre_tokenizer"):
        if isinstance(spec.get(key), dict) and spec[key].get("type") == "Prepend":
            spec[key], found = None, True
        visit(spec.get(key))
    return spec, found


def prepends_space(tokenizer) -> bool:
    """Whether ``tokenizer`` puts a space before the text it encodes (SentencePiece's convention)."""
    return _without_leading_space(backend_spec(tokenizer))[1]


def continuation_encoder(tokenizer):
    """A function: text -> the ids ``tokenizer`` gives it as the continuation of a text: no special
    tokens added and no space put before it (its own model under a copy of its normalizer and
    pre-tokenizer with that turned off; the tokenizer itself is not changed). Special-token strings in
    such a text are encoded as text."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers

    backend = tokenizer.backend_tokenizer
    spec, changed = _without_leading_space(backend_spec(tokenizer))
    if not changed:
        return lambda text: backend.encode(text, add_special_tokens=False).ids if text else []
    copy = Tokenizer(backend.model)  # the same model object: nothing of the vocabulary is copied
    for name, kind in (("normalizer", normalizers.NFC), ("pre_tokenizer", pre_tokenizers.Whitespace)):
        if spec[name] is not None:
            part = kind()
            part.__setstate__(json.dumps(spec[name]).encode())  # any kind of step, from its JSON
            setattr(copy, name, part)
    return lambda text: copy.encode(text, add_special_tokens=False).ids if text else []


def split_complete(data: bytes) -> tuple[str, bytes]:
    """``data`` as the text of its complete UTF-8 characters and the bytes of an incomplete one at its
    end (held until the bytes that complete it arrive); bytes that can never be UTF-8 become U+FFFD."""
    for back in range(1, min(3, len(data)) + 1):
        lead = data[-back]
        if lead & 0xC0 != 0x80:  # not a continuation byte: the last character starts here
            needed = 2 if 0xC0 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if 0xF0 <= lead < 0xF8 else 1
            if needed > back:
                return data[:-back].decode(errors="replace"), data[-back:]
            break
    return data.decode(errors="replace"), b""
