"""What a head is trained on, read from the files a user points at: *texts* (read as they are) and
*prompts* (which the model answers first: `hf_polybasic.training.answers`).

* a file: its whole text (``.jsonl``: one JSON value per line, see below);
* a folder: every file under it whose suffix is one of `TEXT_SUFFIXES`, in path order (hidden
  folders skipped);
* a JSONL line of *texts*: a JSON string, or an object with ``"text"``;
* a JSONL line of *prompts*: a JSON string, or an object with ``"prompt"`` (a string), ``"messages"``
  (a chat: ``[{"role": ..., "content": ...}, ...]``) or ``"turns"`` (Spec-Bench's question files: its
  first turn); a ``.txt`` file of prompts holds one per non-empty line.

Texts are streamed: a folder of sources is read only as far as the token budget needs
(`token_windows`). Training reads fixed windows of ``seq_len`` tokens cut from the texts laid end to end,
an end-of-text id between two (the tail shorter than a window is left out).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")


def _files(paths: Sequence, what: str) -> list[Path]:
    """Every file ``paths`` name (folders expanded), each checked to exist."""
    files = []
    for given in paths:
        path = Path(given).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise ValueError(f"train_head: {what} folder {str(path)!r} holds no file ending in "
                                 f"{', '.join(TEXT_SUFFIXES)}")
            files += found
        else:
            raise ValueError(f"train_head: {what} path {str(path)!r} does not exist; pass files or folders of text")
    return files


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"train_head: {what} file {str(path)!r} is not UTF-8 text") from None


def _json_lines(path: Path, what: str) -> Iterator[tuple[int, object]]:
    for number, line in enumerate(_read(path, what).splitlines(), 1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except ValueError as error:
                raise ValueError(f"train_head: {path}:{number}: not a JSON line ({error})") from None


def read_texts(paths: Sequence) -> Iterator[str]:
    """The texts of ``paths`` (files or folders), in order (see the module docstring)."""
    for path in _files(paths, "texts"):
        if path.suffix != ".jsonl":
            yield _read(path, "texts")
            continue
        for number, value in _json_lines(path, "texts"):
            if isinstance(value, str):
                yield value
            elif isinstance(value, dict) and isinstance(value.get("text"), str):
                yield value["text"]
            else:
                raise ValueError(f"train_head: {path}:{number}: a line of texts is a JSON string or an object with "
                                 "\"text\"; a file of prompts (\"prompt\", \"messages\", \"turns\") goes in prompts")


def read_prompts(paths: Sequence) -> list[list[dict]]:
    """Each prompt of ``paths`` as a chat (a list of messages), in order (see the module docstring)."""
    prompts = []
    for path in _files(paths, "prompts"):
        if path.suffix != ".jsonl":
            prompts += [[{"role": "user", "content": line}] for line in _read(path, "prompts").splitlines()
                        if line.strip()]
            continue
        for number, value in _json_lines(path, "prompts"):
            prompts.append(_chat(value, f"{path}:{number}"))
    return prompts


def _chat(value, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, dict):
        if isinstance(value.get("prompt"), str):
            return [{"role": "user", "content": value["prompt"]}]
        turns = value.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return [{"role": "user", "content": turns[0]}]
        messages = value.get("messages")
        if isinstance(messages, list) and messages and all(isinstance(m, dict) and "content" in m for m in messages):
            return [dict(m) for m in messages]
    raise ValueError(f"train_head: {where}: a prompt is a JSON string or an object with \"prompt\" (a string), "
                     "\"messages\" (a list of {\"role\", \"content\"}) or \"turns\" (a list of strings)")


def token_windows(documents: Iterable[list[int]], seq_len: int, separator: int | None,
                  max_tokens: int | None = None) -> torch.Tensor:
    """``[N, seq_len]`` int32: the token lists of ``documents`` laid end to end (``separator`` between two,
    where not None) and cut into windows, the shorter tail left out; reads documents only until
    ``max_tokens`` tokens are laid (None: all)."""
    laid: list[int] = []
    for ids in documents:
        if laid and separator is not None:
            laid.append(separator)
        laid += ids
        if max_tokens is not None and len(laid) >= max_tokens:
            laid = laid[:max_tokens]
            break
    count = len(laid) // seq_len
    return torch.tensor(laid[: count * seq_len], dtype=torch.int32).view(count, seq_len)
