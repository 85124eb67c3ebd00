"""A private on-disk cache of what is slow to recompute for the same input: each file's extracted
text (``fpcli.ingest``) and each prompt fit (``fpcli.prompt``).

A repeat ``fp ask`` about the same file skips PDF parsing and the tokenization of the whole
document. Entries are JSON files named by the sha256 of their key:

- a **document** entry is keyed by the sha256 of the file's bytes plus everything that changes
  extraction (``fp``'s version, the extractor and its version, the reader: PDF or text); it holds
  the text, page offsets, page lists, notes and warnings. PDFs read with ``--password`` are never
  cached (their text is protected by that password; a cache file would hand it to whoever can read
  the file), nor documents with an error or skipped pages (a page timeout depends on the load).
- a **fit** entry is keyed by the documents' names and text hashes, the tokenizer's identity
  (``tokenizer_identity``), the prompt budget, the cut mode, the system prompt and ``fp``'s
  version; it holds the cut documents, the cut records and each document's token count.

Layout and safety: ``<root>/<kind>/<sha256>.json``, the folders 0700 (a cache folder that others
can enter is not used), files written to a temporary file in the same folder then renamed (a
reader never sees half an entry), bounded to ``CacheConfig.max_bytes`` per kind by evicting the
least recently used entries. An unreadable, corrupt or mismatched entry is a miss, and the next
store replaces it; no cache problem ever fails a command.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fpcli.prompt import FitCache

FORMAT = 1  # entry layout version: a change of layout misses every older entry
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class CacheConfig:
    """Where the cache lives and how large it may grow.

    Attributes:
        root: the cache folder (``default_config`` puts it under ``fpcli.models.cache_dir()``).
        max_bytes: bytes allowed per kind of entry (documents, fits); the least recently used
            entries are evicted beyond it.
        enabled: ``False`` turns every lookup into a miss and every store into nothing.
    """

    root: Path
    max_bytes: int = 256 * 1024 * 1024
    enabled: bool = True


def default_config() -> CacheConfig:
    """``<fpcli.models.cache_dir()>/docs``, 256 MiB per kind."""
    from fpcli.models import cache_dir

    return CacheConfig(root=cache_dir() / "docs")


def digest(*parts: Any) -> str:
    """sha256 hex of the JSON form of ``parts`` (the one key function of every entry)."""
    return hashlib.sha256(json.dumps(parts, ensure_ascii=False, sort_keys=True).encode("utf-8")).hexdigest()


def tokenizer_identity(model_dir: str | os.PathLike | None) -> str | None:
    """sha256 over the tokenizer files of a Hugging Face model folder (``TOKENIZER_FILES`` that
    exist, names and bytes), or ``None`` when there is none or ``model_dir`` is ``None`` (a fit
    is then not cached)."""
    if not model_dir:
        return None
    h = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        try:
            data = path.read_bytes()
        except OSError:
            continue
        found = True
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest() if found else None


def fit_cache_for(config: CacheConfig, model_dir: str | os.PathLike | None) -> "FitCache | None":
    """The ``fpcli.prompt.FitCache`` of the engine whose model folder is ``model_dir`` (its
    ``model_path``), or ``None`` when its tokenizer cannot be identified."""
    from fpcli.prompt import FitCache

    tokenizer_id = tokenizer_identity(model_dir)
    return None if tokenizer_id is None else FitCache(DiskCache(config, "fits"), tokenizer_id)


class DiskCache:
    """One kind of entry (``kind``: a sub-folder of ``config.root``): ``get``/``put`` of JSON
    objects by key. Never raises for a cache problem: a failure is a miss or a store not done."""

    def __init__(self, config: CacheConfig, kind: str) -> None:
        self.config = config
        self.folder = Path(config.root) / kind

    def _ready(self) -> bool:
        """Create the folders 0700; ``False`` when the cache is off or the folder is not private."""
        if not self.config.enabled:
            return False
        try:
            for folder in (Path(self.config.root), self.folder):
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                st = folder.stat()
                if st.st_uid != os.getuid():
                    return False
                if stat.S_IMODE(st.st_mode) & 0o077:
                    os.chmod(folder, 0o700)
            return True
        except OSError:
            return False

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def get(self, key: str) -> dict | None:
        """The entry stored under ``key``, or ``None`` (absent, unreadable, corrupt, other format)."""
        if not self._ready():
            return None
        path = self._path(key)
        try:
            with open(path, encoding="utf-8") as f:
                entry = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
            return None
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        value = entry.get("value")
        return value if isinstance(value, dict) else None

    def put(self, key: str, value: dict) -> bool:
        """Store ``value`` (JSON-serialisable) under ``key`` atomically, then evict beyond the
        size bound; ``True`` when stored."""
        if not self._ready():
            return False
        data = json.dumps({"format": FORMAT, "key": key, "value": value}, ensure_ascii=False).encode("utf-8")
        if len(data) > self.config.max_bytes:
            return False
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".json")  # 0600
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self._path(key))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError:
            return False
        self.evict()
        return True

    def evict(self) -> None:
        """Delete the least recently used entries until the folder holds at most ``max_bytes``."""
        entries = []
        try:
            for p in self.folder.glob("*.json"):
                with contextlib.suppress(OSError):
                    st = p.stat()
                    entries.append((st.st_mtime, st.st_size, p))
        except OSError:
            return
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= self.config.max_bytes:
                break
            with contextlib.suppress(OSError):
                p.unlink()
            total -= size

