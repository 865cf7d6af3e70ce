"""Which files of a model repository a stage reads.

Part of the pipeline contract (torch-free): the operator renders each stage's :class:`StageFiles` into the
pipeline file, ``omnimodel fetch`` downloads the union over the stages, and a stage loads (or downloads,
without a cache) only its own set.

Patterns are matched against repository-relative POSIX paths, one path segment at a time:

- ``*`` matches any characters except ``/`` (``*.json`` is every JSON file at the top level only);
- ``?`` one character except ``/``; ``[abc]`` / ``[!abc]`` a character class;
- ``**`` as a whole segment matches any number of segments (``vae/**`` is everything under ``vae/``,
  ``**/config.json`` a ``config.json`` at any depth, ``**`` alone every file);
- a pattern ending in ``/`` means everything under that folder (``vae/`` is ``vae/**``).

(Unlike ``huggingface_hub``'s ``allow_patterns``, whose ``fnmatch`` lets ``*`` cross ``/``: the fetch turns
a stage's set into exact file names before it asks the Hub for anything.)

``tensor_prefixes`` pick the shards of one checkpoint split across stages (Qwen2.5-Omni's ``thinker.``,
``talker.``, ``token2wav.`` tensors): the stage needs the checkpoint's index and every shard the index maps
a tensor with one of those prefixes to. A checkpoint without an index is one file, needed whole.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Final, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The index files of a sharded checkpoint at the top of a repository, preferred in this order.
CHECKPOINT_INDEXES: Final = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# An unsharded checkpoint, needed whole by every stage with tensor prefixes.
SINGLE_CHECKPOINTS: Final = ("model.safetensors", "pytorch_model.bin")


class StageFilesError(ValueError):
    """A stage's file set cannot be worked out from the repository (no checkpoint, a prefix nothing has)."""


class StageFiles(BaseModel):
    """The files one stage reads: paths matching ``patterns`` plus the shards holding ``tensor_prefixes``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    patterns: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    tensor_prefixes: tuple[Annotated[str, Field(min_length=1)], ...] = ()

    @model_validator(mode="after")
    def _valid(self) -> Self:
        if not self.patterns and not self.tensor_prefixes:
            raise ValueError("a stage's files need at least one pattern or tensor prefix")
        for pattern in self.patterns:
            if pattern.startswith("/") or ".." in pattern.split("/") or "\\" in pattern:
                raise ValueError(f"file pattern {pattern!r} must be a relative path without '..' or '\\'")
            pattern_regex(pattern)  # raises on an unclosed character class
        return self

    def matches(self, path: str) -> bool:
        """True when ``path`` matches one of the patterns (tensor prefixes are not looked at)."""
        return any(pattern_regex(p).fullmatch(path) for p in self.patterns)


@functools.lru_cache(maxsize=512)
def pattern_regex(pattern: str) -> re.Pattern[str]:
    """The compiled regular expression of one file pattern (see the module docstring)."""
    if pattern.endswith("/"):
        pattern += "**"
    parts = pattern.split("/")
    out: list[str] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append("(?:[^/]+/)*[^/]+" if last else "(?:[^/]+/)*")
        else:
            out.append(_segment(part) + ("" if last else "/"))
    try:
        return re.compile("".join(out))
    except re.error as err:
        raise ValueError(f"bad file pattern {pattern!r}: {err}") from None


def _segment(part: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(part):
        c = part[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = part.find("]", i + 2 if part[i + 1 : i + 2] in ("!", "]") else i + 1)
            if end < 0:
                raise ValueError(f"unclosed '[' in {part!r}")
            body = part[i + 1 : end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def checkpoint_index(repo_files: Iterable[str]) -> str | None:
    """The index of the repository's sharded top-level checkpoint, if it has one."""
    names = set(repo_files)
    return next((name for name in CHECKPOINT_INDEXES if name in names), None)


def needs_weight_map(files: StageFiles | None, repo_files: Iterable[str]) -> str | None:
    """The index file whose weight map :func:`select_files` needs for ``files``, else None."""
    if files is None or not files.tensor_prefixes:
        return None
    return checkpoint_index(repo_files)


def select_files(
    files: StageFiles | None,
    repo_files: Iterable[str],
    weight_map: Mapping[str, str] | None = None,
) -> tuple[str, ...]:
    """The sorted paths of ``repo_files`` a stage with ``files`` needs (``None``: every file).

    ``weight_map`` is the ``weight_map`` of the checkpoint index :func:`needs_weight_map` names (tensor
    name -> shard file); without an index the single checkpoint file is taken whole.
    """
    listing = sorted(set(repo_files))
    if files is None:
        return tuple(listing)
    chosen = {path for path in listing if files.matches(path)}
    if files.tensor_prefixes:
        chosen |= _checkpoint_files(files.tensor_prefixes, listing, weight_map)
    return tuple(sorted(chosen))


def _checkpoint_files(prefixes: tuple[str, ...], listing: list[str], weight_map: Mapping[str, str] | None) -> set[str]:
    index = checkpoint_index(listing)
    if index is None:
        single = next((name for name in SINGLE_CHECKPOINTS if name in listing), None)
        if single is None:
            raise StageFilesError(
                f"tensor prefixes {', '.join(prefixes)} need a checkpoint, but the repository has none of "
                f"{', '.join(CHECKPOINT_INDEXES + SINGLE_CHECKPOINTS)}"
            )
        return {single}
    if weight_map is None:
        raise StageFilesError(f"tensor prefixes {', '.join(prefixes)} need the weight map of {index}")
    shards = {shard for key, shard in weight_map.items() if key.startswith(prefixes)}
    if not shards:
        raise StageFilesError(f"no tensor in {index} starts with {' or '.join(repr(p) for p in prefixes)}")
    missing = sorted(shards.difference(listing))
    if missing:
        raise StageFilesError(f"{index} maps tensors to {', '.join(missing)}, which the repository lacks")
    return {index, *shards}
