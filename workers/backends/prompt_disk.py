"""The prompt cache's disk tier: kept KV caches in files, so that long prompts outlive the worker.

The memory tier (workers/backends/prompt_cache.py) is lost with the process: a restart (which `mlxq up`
does after a crash) or a kill -9 means processing every long conversation and agent prompt again. Here
each entry of at least DISK_MIN_TOKENS that the memory tier keeps is also written to a file, by a thread
of its own (the MLX thread only hands over arrays it has already evaluated), so a kill -9 loses the
entries of its last moments only; a warm stop writes what the memory tier holds that is not on disk yet.

- **Files.** One safetensors file per entry (`mx.save_safetensors`: its keys and values, and in its
  metadata the token ids and the namespace), named after a hash of both. Written to a temporary name in
  the same directory, flushed to the disk, then renamed: a reader never sees half a file. Temporary files
  left by a killed writer are removed at the next start (the directory is locked to one worker).
- **Namespaces.** An entry serves only the model it was made with (its directory, and a fingerprint of
  its weight files' sizes and times and of its config.json and mlxq.json), the same LoRA adapter (its
  name and fingerprint), the same KV quantization and the same dtype (`Namespace`).
- **Finding.** An index in memory, rebuilt from the files' headers at start: the hash of each entry's
  first k·BLOCK tokens, for every k. A prompt's longest prefix on disk is its longest block boundary
  whose hash is known: a few dozen hashes for a 4,000-token prompt, no file read. The file's own token
  ids then say exactly how far it matches (the memory tier's walk, once the entry is there).
- **Loading** happens on the thread that prepares the request (workers/backends/prepare.py), not on
  the MLX thread; the arrays are evaluated there (MLX streams belong to the thread that made them: an
  array loaded lazily on one thread cannot be evaluated on another). A file that does not match what its
  name and the index promise (its namespace, its token ids, its arrays' shapes, its size) is deleted,
  never served.
- **Budget.** MLXQ_PROMPT_CACHE_DISK_MB, least recently used first (a file's modification time is its
  last use, so the order survives a restart). An entry that extends another on disk replaces it.

The payload is not checksummed: the rename makes a crash of the worker safe, and a check of every byte
would cost about as much as reading them again (0.5 s for a 4,000-token entry of an 8B model).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from jobs.dirlock import DirectoryInUse, lock_directory
from workers.backends import quantized_kv
from workers.backends.quantized_kv import QuantizedCache

log = logging.getLogger(__name__)

DISK_MIN_TOKENS = 256
"""Shortest entry written to disk and shortest prefix loaded from it: below that, processing the tokens
again (a few hundred ms on a CPU, milliseconds on a GPU) costs about what reading a file does."""

BLOCK = 64
"""Tokens between two prefix hashes in the index: a prefix on disk is found at this granularity (the
file's token ids then give the exact match)."""

MAX_PENDING = 8
"""Entries waiting for the writer at most; more are not written then (a warm stop offers them again)."""

FLUSH_TIMEOUT_S = 10.0
"""How long a warm stop waits for the writer (`mlxq up` kills a worker that takes 20 s to stop)."""

FORMAT = "mlxq-prompt-cache/1"
"""The files' format, in their metadata: a file of another format is not ours to serve."""

LOCK_NAME = ".lock"
"""The lock file that keeps the directory to one worker."""

_NAME = re.compile(r"^[0-9a-f]{32}\.safetensors$")
_TEMP_PREFIX = ".tmp-"


class BadEntry(Exception):
    """A file that is not what its name and the index say (truncated, corrupt, of another model)."""


@dataclass(frozen=True)
class Namespace:
    """What an entry's keys and values depend on besides its tokens: entries serve their own namespace only."""

    model: str  # the model's directory, resolved
    fingerprint: str  # of its weights (sizes, times) and its config.json / mlxq.json
    adapter: str = ""  # the LoRA adapter's name, if any
    adapter_fingerprint: str = ""
    kv: str = ""  # "bits/group_size" of a quantized cache, "" for a plain one
    float32: bool = False  # the model upcast to float32 (its caches are float32 too)
    layers: int = 0

    @property
    def text(self) -> str:
        """Its canonical JSON (what the files' metadata holds)."""
        return json.dumps(asdict(self), sort_keys=True)

    @property
    def digest(self) -> bytes:
        """A hash of it: the seed of its entries' hashes."""
        return hashlib.blake2b(self.text.encode(), digest_size=16).digest()


def fingerprint(directory: Path, stat_globs: tuple[str, ...], read: tuple[str, ...]) -> str:
    """A hash of a directory's files that matter: the size and time of the big ones (weights), the bytes of
    the small ones (configs). Cheap: no weight is read."""
    h = hashlib.blake2b(digest_size=16)
    for pattern in stat_globs:
        for path in sorted(directory.glob(pattern)):
            st = path.stat()
            h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    for name in read:
        path = directory / name
        h.update(name.encode() + (path.read_bytes() if path.is_file() else b"-"))
    return h.hexdigest()


def namespace_for(resident, kv, adapters_dir: Path) -> Namespace | None:
    """The namespace of a resident model's kept caches; None when its caches are not all plain KV caches
    (sliding windows, recurrent layers: the disk tier does not keep those)."""
    cache = quantized_kv.make_cache(resident.model, kv)
    if not cache or not all(type(c) in (KVCache, QuantizedCache) for c in cache):
        return None
    path = Path(resident.info.path).resolve()
    adapter = getattr(resident, "adapter", None) or ""
    adapter_fp = fingerprint(Path(adapters_dir) / adapter, ("*.safetensors",), ("adapter_config.json",)) \
        if adapter else ""
    return Namespace(str(path), fingerprint(path, ("*.safetensors",), ("config.json", "mlxq.json")), adapter,
                     adapter_fp, f"{kv.bits}/{kv.group_size}" if kv else "", bool(resident.float32), len(cache))


def _token_bytes(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def prefix_digests(ns: bytes, tokens: list[int], block: int = BLOCK) -> list[bytes]:
    """The hashes of `tokens`' first k·block tokens, k = 1, 2, ... (within namespace `ns`)."""
    data, h, out = _token_bytes(tokens), hashlib.blake2b(ns, digest_size=16), []
    for k in range(len(tokens) // block):
        h.update(data[4 * k * block:4 * (k + 1) * block])
        out.append(h.digest())
    return out


def entry_name(ns: bytes, tokens: list[int]) -> str:
    """The file name of the entry of `tokens` in namespace `ns`."""
    return hashlib.blake2b(ns + _token_bytes(tokens), digest_size=16).hexdigest() + ".safetensors"


@dataclass
class Entry:
    """An entry on disk, as the index knows it."""

    name: str
    ns: bytes
    length: int  # its tokens
    nbytes: int  # its file's size
    blocks: list[bytes] = field(repr=False)  # prefix_digests of its tokens


class Index:
    """The disk tier's entries in memory: by prefix hash, and in order of last use (pure: no files)."""

    def __init__(self):
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.by_prefix: dict[bytes, set[str]] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def add(self, entry: Entry) -> None:
        """Add (or refresh) an entry, as the most recently used."""
        self.remove(entry.name)
        self.entries[entry.name] = entry
        self.nbytes += entry.nbytes
        for digest in entry.blocks:
            self.by_prefix.setdefault(digest, set()).add(entry.name)

    def remove(self, name: str) -> Entry | None:
        """Forget an entry; it, if it was known."""
        entry = self.entries.pop(name, None)
        if entry is None:
            return None
        self.nbytes -= entry.nbytes
        for digest in entry.blocks:
            names = self.by_prefix.get(digest)
            if names is not None:
                names.discard(name)
                if not names:
                    del self.by_prefix[digest]
        return entry

    def touch(self, name: str) -> None:
        """Mark an entry used now."""
        if name in self.entries:
            self.entries.move_to_end(name)

    def best(self, ns: bytes, tokens: list[int]) -> tuple[Entry, int] | None:
        """The entry sharing the longest block-aligned prefix with `tokens` (the most recently used of those
        that do), and that prefix's length; None if none shares a block."""
        for k, digest in reversed(list(enumerate(prefix_digests(ns, tokens), 1))):
            names = self.by_prefix.get(digest)
            if names:
                name = next(n for n in reversed(self.entries) if n in names)
                return self.entries[name], k * BLOCK
        return None

    def prefixes_of(self, ns: bytes, tokens: list[int]) -> list[Entry]:
        """Entries whose tokens are a strict prefix of `tokens` (an entry of them holds theirs too)."""
        first = prefix_digests(ns, tokens[:BLOCK])
        if not first:
            return []
        return [self.entries[name] for name in self.by_prefix.get(first[0], ())
                if self.entries[name].length < len(tokens)
                and entry_name(ns, tokens[:self.entries[name].length]) == name]

    def over(self, budget: int, keep: str | None = None) -> list[Entry]:
        """The least recently used entries to drop so that the rest fit `budget` bytes (never `keep`)."""
        total, out = self.nbytes, []
        for entry in self.entries.values():
            if total <= budget:
                break
            if entry.name != keep:
                out.append(entry)
                total -= entry.nbytes
        return out


# --- files ---------------------------------------------------------------------------------------


def _arrays(cache: list) -> dict[str, mx.array]:
    """The arrays of a cache to store, by name: per layer its keys and values (three parts each, quantized)."""
    out = {}
    for i, c in enumerate(cache):
        keys, values = c.keys_and_values()  # its first `offset` tokens (`state` is the whole buffer, in mlx-lm)
        if isinstance(keys, mx.array):
            out[f"{i}.k"], out[f"{i}.v"] = keys, values
        else:
            for j, (k, v) in enumerate(zip(keys, values, strict=True)):
                out[f"{i}.k.{j}"], out[f"{i}.v.{j}"] = k, v
    return out


def write_entry(directory: Path, name: str, arrays: dict[str, mx.array], ns: Namespace, tokens: list[int]) -> int:
    """Write an entry's file (a temporary one, synced, then renamed into place); its size."""
    metadata = {"format": FORMAT, "namespace": ns.text,
                "tokens": base64.b64encode(_token_bytes(tokens)).decode()}
    temp = directory / f"{_TEMP_PREFIX}{uuid.uuid4().hex}.safetensors"
    try:
        mx.save_safetensors(str(temp), arrays, metadata)
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data reaches the disk before the name does
        finally:
            os.close(fd)
        os.replace(temp, directory / name)
    finally:
        temp.unlink(missing_ok=True)
    return (directory / name).stat().st_size


def read_header(path: Path) -> dict:
    """A safetensors file's header, checked against the file's size (a truncated file fails: BadEntry)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise BadEntry("shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, 100 * 2**20):
            raise BadEntry("its header runs past the end of the file")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise BadEntry("its header is not JSON") from None
    ends = [t["data_offsets"][1] for key, t in header.items() if key != "__metadata__"]
    if 8 + n + max(ends, default=0) != size:
        raise BadEntry(f"{size} bytes where its header says {8 + n + max(ends, default=0)}")
    return header


def _tokens_of(metadata: dict) -> list[int]:
    try:
        return np.frombuffer(base64.b64decode(metadata["tokens"], validate=True), dtype="<u4").tolist()
    except (KeyError, ValueError):
        raise BadEntry("its token ids are missing or garbled") from None


def describe(path: Path) -> tuple[Namespace, list[int]]:
    """An entry file's namespace and token ids, from its header alone; BadEntry if it is not a sound entry
    of ours (its name not the hash of both, its size not its header's)."""
    metadata = read_header(path).get("__metadata__") or {}
    if metadata.get("format") != FORMAT:
        raise BadEntry(f"not a {FORMAT} file")
    try:
        ns = Namespace(**json.loads(metadata["namespace"]))
    except (KeyError, TypeError, ValueError):
        raise BadEntry("its namespace is missing or garbled") from None
    tokens = _tokens_of(metadata)
    if ns.text != metadata["namespace"] or entry_name(ns.digest, tokens) != path.name:
        raise BadEntry("its name is not the hash of its namespace and tokens")
    return ns, tokens


def read_entry(path: Path, ns: Namespace) -> tuple[list[int], list]:
    """An entry's token ids and its cache, evaluated (usable on any thread); BadEntry where the file is not a
    sound entry of `ns`; FileNotFoundError once it is gone (evicted meanwhile)."""
    if not path.is_file():
        raise FileNotFoundError(path)
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise BadEntry(str(exc)) from None
    if metadata.get("format") != FORMAT or metadata.get("namespace") != ns.text:
        raise BadEntry("another namespace (model, adapter or KV settings) than its name says")
    tokens = _tokens_of(metadata)
    if entry_name(ns.digest, tokens) != path.name:
        raise BadEntry("its token ids are not those its name says")
    cache = _cache_of(arrays, ns, len(tokens))
    try:
        mx.eval([c.keys_and_values() for c in cache])
    except RuntimeError as exc:  # a read that fails (a file cut short after its header was read)
        raise BadEntry(str(exc)) from None
    return tokens, cache


def _cache_of(arrays: dict[str, mx.array], ns: Namespace, length: int) -> list:
    """Caches holding the file's arrays; BadEntry where their names or shapes are not those of `ns`'s model."""
    parts = 3 if ns.kv else 1
    expected = {f"{i}.{kv}{f'.{j}' if ns.kv else ''}" for i in range(ns.layers) for kv in "kv" for j in range(parts)}
    if set(arrays) != expected:
        raise BadEntry(f"{len(arrays)} arrays where {ns.layers} layers need {len(expected)}")
    shapes = set()
    for name, a in arrays.items():
        if a.ndim != 4 or a.shape[0] != 1 or a.shape[2] != length:
            raise BadEntry(f"array {name} has shape {a.shape}, not (1, heads, {length}, dims)")
        shapes.add((name.split(".", 1)[1], a.shape, a.dtype))
    if len(shapes) != 2 * parts:  # every layer's keys (values, and each part) alike
        raise BadEntry("its layers' arrays differ in shape or type")
    cache = []
    for i in range(ns.layers):
        if ns.kv:
            bits, group_size = map(int, ns.kv.split("/"))
            c = QuantizedCache(group_size=group_size, bits=bits)
            c.keys = tuple(arrays[f"{i}.k.{j}"] for j in range(3))
            c.values = tuple(arrays[f"{i}.v.{j}"] for j in range(3))
        else:
            c = KVCache()
            c.keys, c.values = arrays[f"{i}.k"], arrays[f"{i}.v"]
        c.offset = length
        cache.append(c)
    return cache


# --- the tier -------------------------------------------------------------------------------------


@dataclass
class Loaded:
    """An entry read from disk for a prompt: its tokens and its cache (to put in the memory tier)."""

    tokens: list[int]
    cache: list


class DiskTier:
    """The disk tier of one worker: its directory (locked), its index, and the thread that writes."""

    def __init__(self, directory: Path, budget_bytes: int, lock_fd: int):
        self.directory, self.budget, self._lock_fd = directory, budget_bytes, lock_fd
        self.index = Index()
        self.namespaces: dict[str, Namespace] = {}  # the memory tier's keys -> their namespaces (warm stop)
        self._mutex = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0  # writes queued or under way
        self._idle = threading.Condition(self._mutex)
        self._rebuild()
        self._writer = threading.Thread(target=self._write_loop, name="mlxq-prompt-disk", daemon=True)
        self._writer.start()

    # index

    def _rebuild(self) -> None:
        """The index from the directory's files (headers only), oldest use first; leftovers removed."""
        found = []
        for path in self.directory.iterdir():
            if path.name.startswith(_TEMP_PREFIX):  # a write a killed worker left half done
                path.unlink(missing_ok=True)
            elif _NAME.match(path.name):
                try:
                    ns, tokens = describe(path)
                    found.append((path.stat().st_mtime, Entry(path.name, ns.digest, len(tokens),
                                                                 path.stat().st_size, prefix_digests(ns.digest, tokens))))
                except (BadEntry, OSError) as exc:
                    self._drop(path, exc)
        for _, entry in sorted(found, key=lambda item: item[0]):
            self.index.add(entry)
        for entry in self.index.over(self.budget):  # the budget may have shrunk since
            self._delete(entry)
        log.info("prompt cache on disk: %d entries, %.0f MiB in %s (budget %.0f MiB)", len(self.index),
                 self.index.nbytes / 2**20, self.directory, self.budget / 2**20)

    def _drop(self, path: Path, why) -> None:
        """Delete a file that must not be served."""
        log.warning("prompt cache on disk: dropping %s: %s", path.name, why)
        with self._mutex:
            self.index.remove(path.name)
        path.unlink(missing_ok=True)

    def _delete(self, entry: Entry) -> None:
        with self._mutex:
            self.index.remove(entry.name)
        (self.directory / entry.name).unlink(missing_ok=True)

    # reading (preparing threads)

    def load(self, ns: Namespace, tokens: list[int], have: int = 0) -> Loaded | None:
        """The disk entry of the longest prefix of `tokens`, read and evaluated, if it is longer than `have`
        (what the memory tier holds) and at least DISK_MIN_TOKENS; None otherwise. Never raises."""
        with self._mutex:
            found = self.index.best(ns.digest, tokens)
        if found is None or found[1] <= have or found[1] < DISK_MIN_TOKENS:
            return None
        entry, matched = found
        path = self.directory / entry.name
        try:
            stored, cache = read_entry(path, ns)
        except FileNotFoundError:  # evicted meanwhile
            with self._mutex:
                self.index.remove(entry.name)
            return None
        except Exception as exc:  # noqa: BLE001 (whatever is wrong with it, it is not served: the prompt is processed)
            self._drop(path, exc)
            return None
        if stored[:matched] != tokens[:matched]:  # a hash collision: never served
            return None
        with self._mutex:
            self.index.touch(entry.name)
        try:
            os.utime(path)  # its last use, for the order after a restart
        except OSError:
            pass
        return Loaded(stored, cache)

    # writing (the MLX thread hands over; the writer thread writes)

    def register(self, key: str, ns: Namespace) -> None:
        """Say which namespace the memory tier's `key` is (for the warm stop's flush)."""
        self.namespaces[key] = ns

    def save(self, ns: Namespace, tokens: list[int], cache: list, wait: bool = False) -> bool:
        """Hand an entry (its arrays evaluated: on the MLX thread) to the writer; False if it is not written
        (too short, already on disk, or the writer is behind and `wait` is not set)."""
        if len(tokens) < DISK_MIN_TOKENS or any(c.offset != len(tokens) for c in cache):
            return False
        name = entry_name(ns.digest, tokens)
        with self._mutex:
            if name in self.index:
                self.index.touch(name)
                return False
            if self._pending >= MAX_PENDING and not wait:
                return False
            self._pending += 1
        arrays = _arrays(cache)
        mx.eval(list(arrays.values()))  # views of evaluated buffers: nothing left to compute on the writer
        self._jobs.put((ns, list(tokens), name, arrays))
        return True

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._write(*job)
            except Exception:  # noqa: BLE001 (a full disk must not stop the worker: the entry is just not kept)
                log.warning("prompt cache on disk: could not write an entry", exc_info=True)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _write(self, ns: Namespace, tokens: list[int], name: str, arrays: dict) -> None:
        with self._mutex:
            if sum(a.nbytes for a in arrays.values()) > self.budget or name in self.index:
                return
        nbytes = write_entry(self.directory, name, arrays, ns, tokens)
        with self._mutex:
            self.index.add(Entry(name, ns.digest, len(tokens), nbytes, prefix_digests(ns.digest, tokens)))
            gone = self.index.prefixes_of(ns.digest, tokens) + self.index.over(self.budget, keep=name)
        for entry in {e.name: e for e in gone}.values():
            self._delete(entry)

    def flush(self, prompt_cache, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Write what the memory tier keeps and the disk does not (a warm stop), then wait for the writer."""
        # mlx-lm's LRUPromptCache keeps its entries' (model, tokens) in per-type deques (_lru._lrus).
        kept = [(key, tokens) for lru in prompt_cache._lru._lrus.values() for key, tokens in lru]
        for key, tokens in kept:
            ns = self.namespaces.get(key)
            if ns is not None:
                self.save(ns, list(tokens), prompt_cache._trie.get(key, tokens).prompt_cache, wait=True)
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())

    def close(self) -> None:
        """Stop the writer (after what it holds) and let go of the directory."""
        self._jobs.put(None)
        self._writer.join(FLUSH_TIMEOUT_S)
        os.close(self._lock_fd)


def open_tier(settings) -> DiskTier | None:
    """The worker's disk tier (MLXQ_PROMPT_CACHE_DIR, MLXQ_PROMPT_CACHE_DISK_MB), or None: off, or the
    directory is another process's (two workers must not share one: each would evict the other's files)."""
    if not settings.prompt_cache_dir or settings.prompt_cache_disk_mb <= 0:
        return None
    directory = Path(settings.prompt_cache_dir).expanduser()
    try:
        fd = lock_directory(directory, LOCK_NAME)
    except DirectoryInUse as exc:
        log.warning("prompt cache on disk: %s is in use by another worker (pid %s); this one keeps its prompt "
                    "cache in memory only. Give each worker its own MLXQ_PROMPT_CACHE_DIR.", directory, exc.holder)
        return None
    return DiskTier(directory, settings.prompt_cache_disk_mb * 2**20, fd)


def in_memory(prompt_cache, key: str, tokens: list[int]) -> int:
    """How many of `tokens` the memory tier would resume, read off its trie without changing it (safe beside
    the MLX thread: only dict lookups, each atomic)."""
    node = prompt_cache._trie._trie.get(key)
    matched = shorter = 0
    while node is not None and matched < len(tokens):
        below = node.get(tokens[matched])
        if below is None:
            break
        node, matched = below, matched + 1
        if "__value__" in node:
            shorter = matched
    # Walked further than the last entry on the way: a longer entry below holds as much as was walked, less
    # the prompt's last token, which is always processed (prompt_cache.PromptCache).
    return max(shorter, min(matched, len(tokens) - 1))
