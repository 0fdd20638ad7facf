"""The disk tier: KV blocks kept as files, found again by a new memory service on the same directory.

One file per block, named by its chained key (``manager/chain.py``): ``<64 hex digits>.kv``, mode 0600 in
a directory of mode 0700 (other users must not read a tenant's KV, nor plant blocks). A file is a
fixed header, then the block's bytes exactly as the pool holds them, ``(num_layers, 2, block_size,
num_kv_heads, head_dim)`` in the pool's dtype:

    magic "PSKVBLK\\x01", layout version, payload offset, dtype, block size, layers, KV heads, head dim,
    model fingerprint (its BLAKE2b-256), namespace key, chained block key, payload length,
    XXH3-64 of the payload, XXH3-64 of the header before it

(its struct and the ``TierIdentity`` it is checked against live in ``block_file.py``, which ``tier.py``
imports too), then the block's origin (``manager/chain.py``'s ``BlockOrigin``: its parent's key, then its token
ids, ``block_size * TOKEN_WIDTH`` bytes; zeros when the writer did not know it), and zeros up to the
payload's offset: 4 KiB where the block's bytes are a whole number of 4 KiB pages (every real
model's: 16 tokens of a 64-dim head in 16 bits are one page), so the file can be written with
``O_DIRECT`` (below); else right after the origin.

Why the origin: a restarted service announces the blocks it finds here in its KV events (a router
learns what survived), and an event names a block by its tokens and its parent, which the key alone
cannot give back. It needs no checksum of its own: it is believed only if it chains to the file's
key (``BlockOrigin.is_of``), and a block it is wrong about is still served (the key and the
payload's checksum decide that), only never announced.

Never serve wrong KV: a file is used only when every header field equals what the reader expects
(the model, dtype, block size and layout of the pool, the namespace and the key it was looked up
by) and the payload's checksum matches; anything else (a torn, truncated or flipped file, another
model or layout) is a miss, the file is removed and the reason logged (``kv_tier_file_removed``).
XXH3-64 rather than a cryptographic digest: it guards against accidents (torn writes, bit flips),
not against a writer, and the directory's mode already keeps other users out. It runs at memory
speed, several times faster than CRC-32 or BLAKE2b (docs/benchmarks.md): every block the pool
commits is checked once on its way out, and the writer shares the engine's cores.

Writes are atomic: a temporary file (``.tmp-*``), then ``rename``. No fsync: the tier is a cache,
and a file that a power loss leaves torn fails its checksum and is dropped, so durability would buy
nothing but latency. A write that fails (EACCES, EIO, ...) drops that block with a log line;
serving goes on.

``O_DIRECT`` where the file system takes it: the block goes from one aligned buffer to the device,
not through the page cache. A buffered write costs the writer a page-cache copy and the kernel its
writeback and, at eviction, freeing those pages: more CPU a block than a direct write
(docs/benchmarks.md); with every committed block written, that CPU is taken from the engine's threads. A file
system that refuses it (tmpfs before Linux 6.6, some overlays: EINVAL) gets buffered writes from then
on (logged once: ``kv_tier_direct_io_off``). Reads stay buffered: a block read once is then in the page
cache for the next load of the same prefix.

A full file system (ENOSPC, or EDQUOT: a quota) below the budget: the LRU alone would never free a
byte (the tier is under ``capacity_bytes``), so every later write would fail and the tier would keep
only its oldest blocks forever. Instead the tier lowers its budget to the bytes its files held when
the write failed (``effective_capacity_bytes``, logged once: ``kv_tier_budget_lowered``), evicts
least recently used files until ``ENOSPC_FREE_BLOCKS`` blocks would fit below it (more than the one
block: files take whole file-system blocks, and something else may be growing there), and retries the
write once; a write that still fails drops its block as above. From then on a write evicts before it
writes, as under any budget, and finds the room its victim left (files of one size); a file system
that shrinks further (another writer) gives another ENOSPC, which lowers the budget again. The lowered
budget lasts until the service restarts (it starts from ``capacity_bytes``): a file system that
others fill and then empty again is not watched.

Warm restart: ``open`` rebuilds the index by reading every file's header and origin (no separate
index file to keep consistent with the files: the files are the index), least recently used first
by mtime, which a hit refreshes; ``take_found`` hands the blocks found to the KV events, parents
first. Files of another identity are removed then: a tier serves one model and layout.
LRU within ``capacity_bytes``: a write evicts the least recently used files until it fits (a full file
system lowers that budget, below).

Thread safety: one lock over the index and the counters, never held during file IO. One writer
thread (``TierWorker``) calls ``put`` and ``put_buffer``; any thread may call ``get`` (a load reads several
files at once).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
import struct
import mmap
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import xxhash

from pagedserve.errors import PreconditionError
from pagedserve.log import get_logger

from memory_service.manager.chain import HASH_SIZE, BlockOrigin, root_hash
from memory_service.manager.kv_events import MEDIUM_DISK
from memory_service.tier.block_file import (DIRECT_ALIGN, HEADER_CHECKSUM, HEADER_FIELDS, HEADER_SIZE,
                                            LAYOUT_VERSION, MAGIC, NAMESPACE_KEY_SIZE, TierIdentity)
from memory_service.tier.tier import TierCounters

log = get_logger("memory_service.tier")

FILE_SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
_NAME_PATTERN = re.compile(rf"[0-9a-f]{{{2 * HASH_SIZE}}}\.kv")
# A write error is logged the first time and then every this many (a read-only disk fails them all).
LOG_EVERY_WRITE_ERRORS = 1000
# Blocks' worth of files a write that finds the file system full frees before its one retry.
ENOSPC_FREE_BLOCKS = 4
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskTier:
    """Block files in one directory, LRU within a byte budget (module docstring); an ``IoTier`` (tier.py).

    Args:
        directory: created (0700) if missing; an existing one must belong to this user and is set
            to 0700.
        capacity_bytes: the most its files may take together (``--kv-disk-bytes``); a full file
            system lowers the budget below it (``effective_capacity_bytes``, module docstring).

    Raises:
        PreconditionError: the directory belongs to another user or cannot be made.
    """

    def __init__(self, directory: str | Path, capacity_bytes: int) -> None:
        self.directory = Path(directory)
        self.kind = "disk"
        self.medium = MEDIUM_DISK
        self.capacity_bytes = capacity_bytes
        self.effective_capacity_bytes = capacity_bytes  # lowered by a full file system (module docstring)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.stat(self.directory, follow_symlinks=False)
        except OSError as exc:
            raise PreconditionError(f"kv_disk_dir {str(self.directory)!r}: {exc.strerror}") from exc
        if not self.directory.is_dir() or self.directory.is_symlink():
            raise PreconditionError(f"kv_disk_dir {str(self.directory)!r} is not a directory")
        if st.st_uid != os.getuid():
            raise PreconditionError(f"kv_disk_dir {str(self.directory)!r} belongs to another user")
        try:  # a read-only file system fails here: a clear refusal, not a traceback
            if st.st_mode & 0o777 != 0o700:
                os.chmod(self.directory, 0o700)
            self._lock_fd = _lock_directory(self.directory)
        except OSError as exc:
            raise PreconditionError(f"kv_disk_dir {str(self.directory)!r}: {exc.strerror}: the disk tier needs a "
                                    "directory it can write (or leave --kv-disk-dir out)") from exc
        self.identity: TierIdentity | None = None
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self._num_bytes = 0
        self._num_bytes_written = 0
        self._num_bytes_read = 0
        self._num_write_errors = 0
        self._num_bad_files = 0
        self._is_direct = True  # O_DIRECT writes until the file system refuses one (module docstring)
        self._buffer: mmap.mmap | None = None  # the file a put writes, page-aligned (set by ``open``)
        self._found: dict[bytes, tuple[bytes, BlockOrigin]] = {}  # from ``open`` to ``take_found``: key -> (ns, origin)
        # Told of each block stored (True) or dropped (False), by the thread that did it: KV events.
        self.on_change: Callable[[bytes, bool], None] | None = None

    def close(self) -> None:
        """Releases the directory (its lock) for another service; the files stay for the next one."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the flock goes with the last descriptor of its open file
            self._lock_fd = None

    # --- opening ------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        """The blocks its budget holds (0 before ``open``)."""
        return self.capacity_bytes // self.identity.file_size if self.identity is not None else 0

    def open(self, identity: TierIdentity, pin_memory: bool = False) -> int:
        """Binds the tier to a model and layout, and indexes the files already there (warm restart).

        Leftover temporary files (a write cut short) are removed (one line says how many), and so are
        files that are not this identity's or whose header is damaged (a line each); ``kv_tier_opened``
        counts both. Payloads are checked at load.

        Args:
            identity: the model and layout whose blocks this tier keeps from now on.
            pin_memory: unused (a load copies from a file's bytes, read into pageable memory).

        Returns:
            The number of blocks found.
        """
        found: list[tuple[float, bytes, int]] = []
        origins: dict[bytes, tuple[bytes, BlockOrigin]] = {}
        num_partial = 0
        num_bad_before = self._num_bad_files
        for entry in os.scandir(self.directory):
            if entry.name.startswith(TMP_PREFIX):
                self._unlink(Path(entry.path))
                num_partial += 1
                continue
            if not _NAME_PATTERN.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                continue  # not ours (e.g. the service's id file)
            key = bytes.fromhex(entry.name[: -len(FILE_SUFFIX)])
            try:
                with open_own_file(entry.path) as f:
                    header = f.read(HEADER_SIZE + identity.origin_size)
                    st = os.fstat(f.fileno())
            except NotOurFile as exc:
                self._remove_bad(Path(entry.path), str(exc))
                continue
            except OSError as exc:
                self._remove_bad(Path(entry.path), f"unreadable ({exc.strerror})")
                continue
            problem = _check_header(header, identity, key, None)
            if problem is None and st.st_size != identity.file_size:
                problem = f"truncated ({st.st_size} bytes, expected {identity.file_size})"
            if problem is not None:
                self._remove_bad(Path(entry.path), problem)
                continue
            found.append((st.st_mtime, key, st.st_size))
            origin = BlockOrigin(header[HEADER_SIZE:HEADER_SIZE + HASH_SIZE], header[HEADER_SIZE + HASH_SIZE:])
            if origin.is_of(key):
                origins[key] = (HEADER_FIELDS.unpack_from(header)[9], origin)
        found.sort()
        with self._lock:
            self.identity = identity
            self._buffer = self.new_buffer()
            self._index = OrderedDict((key, size) for _, key, size in found)
            self._num_bytes = sum(size for _, _, size in found)
            self._found = origins
        if num_partial:  # a service killed (or a disk filled) mid-write: said once, not per file
            log.warning("kv_tier_partial_writes_removed", directory=str(self.directory), num_files=num_partial,
                        reason="writes cut short (the service stopped mid-write); those blocks are recomputed")
        log.info("kv_tier_opened", directory=str(self.directory), num_blocks=len(found),
                 num_bytes=self._num_bytes, capacity_bytes=self.capacity_bytes,
                 num_partial_writes_removed=num_partial, num_bad_files_removed=self._num_bad_files - num_bad_before)
        self._evict_until(0)  # a smaller budget than last time
        return len(found)

    def take_found(self) -> list[tuple[bytes, bytes, BlockOrigin]]:
        """The blocks ``open`` found, with their origins, parents first (``IoTier.take_found``)."""
        with self._lock:
            found, self._found = {k: v for k, v in self._found.items() if k in self._index}, {}
        if self.identity is None:
            return []
        digest = self.identity.digest
        children: dict[bytes, list[bytes]] = {}
        for key, (_, origin) in found.items():
            children.setdefault(origin.parent_key, []).append(key)
        # Depth first from each namespace's root: a child right after its parent, so one chain goes
        # out as one event; a block whose parent is gone (evicted) is left out with its children.
        roots = {root_hash(digest, ns_key) for ns_key, _ in found.values()}
        stack = [key for root in roots for key in children.get(root, [])]
        ordered: list[tuple[bytes, bytes, BlockOrigin]] = []
        while stack:
            key = stack.pop()
            ns_key, origin = found[key]
            ordered.append((key, ns_key, origin))
            stack.extend(children.get(key, []))
        return ordered

    # --- lookups ------------------------------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self._index  # a dict lookup: atomic under the GIL

    def get(self, key: bytes, ns_key: bytes) -> memoryview | None:
        """Reads and checks a block (module docstring); a bad file is removed.

        Args:
            key: its chained key.
            ns_key: the namespace key it must carry.

        Returns:
            The block's payload (``identity.bytes_per_block`` bytes), or None (missing or bad).
        """
        identity = self.identity
        with self._lock:
            if identity is None or key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        size, offset = identity.file_size, identity.payload_offset
        buffer = bytearray(size)
        try:
            with open_own_file(path) as f, memoryview(buffer) as into:
                num_read = 0
                while num_read < size:  # a short read (a signal, a network file system) goes on
                    num = f.readinto(into[num_read:])
                    if not num:
                        break
                    num_read += num
                if num_read == size and f.read(1):
                    num_read += 1  # longer than a block: not ours to trust
        except FileNotFoundError:
            self._forget(key)
            return None
        except NotOurFile as exc:  # planted in the directory: a miss, and removed
            self._forget(key)
            self._remove_bad(path, str(exc))
            return None
        except OSError as exc:
            log.warning("kv_tier_read_failed", path=str(path), error=exc.strerror)
            return None
        view = memoryview(buffer)
        problem = _check_header(bytes(view[:HEADER_SIZE]), identity, key, ns_key) if num_read >= HEADER_SIZE else None
        if num_read != size:
            problem = f"truncated ({num_read} bytes, expected {size})"
        elif problem is None:
            (payload_checksum,) = struct.unpack_from("<Q", buffer, HEADER_FIELDS.size - 8)
            if xxhash.xxh3_64_intdigest(view[offset:]) != payload_checksum:
                problem = "payload checksum mismatch"
        if problem is not None:
            self._forget(key)
            self._remove_bad(path, problem)
            return None
        with self._lock:
            self._num_bytes_read += size
        try:
            os.utime(path)  # LRU order for the next restart
        except OSError:
            pass
        return view[offset:]

    # --- writes -------------------------------------------------------------------------------

    def new_buffer(self) -> mmap.mmap:
        """A page-aligned buffer for ``put_buffer``: the block's bytes go at ``identity.payload_offset``
        (a writer that copies its blocks there saves ``put`` a copy)."""
        assert self.identity is not None, "open the tier first"
        return mmap.mmap(-1, -(-self.identity.file_size // DIRECT_ALIGN) * DIRECT_ALIGN)  # anonymous: zeroed

    def put(self, key: bytes, ns_key: bytes, payload: memoryview, origin: BlockOrigin | None = None) -> bool:
        """Writes a block atomically, evicting least recently used files to fit (one writer thread); a
        full file system lowers the budget and the write is retried once (module docstring).

        Args:
            key: its chained key.
            ns_key: its namespace key.
            payload: ``identity.bytes_per_block`` bytes, the block as the pool holds it.
            origin: its parent's key and its tokens (module docstring); None: unknown (zeros).

        Returns:
            True when the block is in the tier afterwards; False when it was dropped (logged).
        """
        identity = self.identity
        if identity is None or len(payload) != identity.bytes_per_block:
            raise ValueError("put: the tier is not open, or the block does not fit its identity")
        if key in self._index:
            return True
        self._buffer[identity.payload_offset:identity.file_size] = payload
        return self.put_buffer(key, ns_key, self._buffer, origin)

    def put_buffer(self, key: bytes, ns_key: bytes, buffer: mmap.mmap, origin: BlockOrigin | None = None) -> bool:
        """``put`` of a block already in a ``new_buffer`` (at ``identity.payload_offset``); the header
        and the origin are written into the same buffer."""
        identity = self.identity
        if identity is None or len(ns_key) != NAMESPACE_KEY_SIZE:
            raise ValueError("put: the tier is not open, or the namespace key does not fit")
        if key in self._index:
            return True
        size, offset = identity.file_size, identity.payload_offset
        if size > self.capacity_bytes:
            return False
        self._evict_until(size)
        view = memoryview(buffer)
        fields = HEADER_FIELDS.pack(MAGIC, LAYOUT_VERSION, offset, identity.dtype.encode(), identity.block_size,
                                    identity.num_layers, identity.num_kv_heads, identity.head_dim,
                                    identity.fingerprint_digest, ns_key, key, identity.bytes_per_block,
                                    xxhash.xxh3_64_intdigest(view[offset:size]))
        buffer[:HEADER_SIZE] = fields + HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))
        origin_bytes = origin.parent_key + origin.token_bytes if origin is not None else b""
        if len(origin_bytes) != identity.origin_size:  # unknown, or not one block's: not kept
            origin_bytes = bytes(identity.origin_size)
        buffer[HEADER_SIZE:HEADER_SIZE + identity.origin_size] = origin_bytes
        try:
            try:
                self._write_file(key, view[:size])
            except OSError as exc:
                if exc.errno not in _FULL_ERRNOS:
                    raise
                self._make_room_on_full_disk(size, exc)
                self._write_file(key, view[:size])  # the one retry
        except OSError as exc:
            with self._lock:
                self._num_write_errors += 1
                num_errors = self._num_write_errors
            if num_errors == 1 or num_errors % LOG_EVERY_WRITE_ERRORS == 0:
                log.warning("kv_tier_write_failed", directory=str(self.directory),
                            error=errno.errorcode.get(exc.errno, str(exc.errno)), detail=exc.strerror,
                            num_write_errors=num_errors, action="block dropped, serving goes on")
            return False
        with self._lock:
            self._index[key] = size
            self._num_bytes += size
            self._num_bytes_written += size
        if self.on_change is not None:
            self.on_change(key, True)
        return True

    def _write_file(self, key: bytes, data: memoryview) -> None:
        """The block's file, atomically (a temporary file, then rename); nothing is left on an OSError.
        ``O_DIRECT`` while the file system takes it and ``data`` is whole pages (module docstring)."""
        tmp = self.directory / f"{TMP_PREFIX}{key.hex()}-{secrets.token_hex(4)}"
        try:
            if self._is_direct and len(data) % DIRECT_ALIGN == 0 and not self._write_direct(tmp, data):
                self._unlink(tmp)
                self._is_direct = False
                log.info("kv_tier_direct_io_off", directory=str(self.directory),
                         reason="the file system refuses O_DIRECT; block files are written through the page cache")
            if not self._is_direct or len(data) % DIRECT_ALIGN:
                self._write_all(tmp, data, 0)
            os.rename(tmp, self._path(key))
        except OSError:
            self._unlink(tmp)  # a partial file would hold the very space that is missing
            raise

    def _write_direct(self, tmp: Path, data: memoryview) -> bool:
        """Writes ``tmp`` with ``O_DIRECT``; False when the file system refuses it (EINVAL from the open
        or the first write, which is aligned). What a short write leaves (a nearly full disk) is no
        longer aligned: it goes through the page cache."""
        try:
            fd = os.open(tmp, _CREATE_FLAGS | os.O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return False
        try:
            num_written = os.write(fd, data)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return False
        finally:
            os.close(fd)
        if num_written < len(data):
            fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW)
            try:
                os.lseek(fd, num_written, os.SEEK_SET)
                _write_rest(fd, data[num_written:])
            finally:
                os.close(fd)
        return True

    @staticmethod
    def _write_all(path: Path, data: memoryview, flags: int) -> None:
        fd = os.open(path, _CREATE_FLAGS | flags, 0o600)
        try:
            _write_rest(fd, data)
        finally:
            os.close(fd)

    def _make_room_on_full_disk(self, size: int, exc: OSError) -> None:
        """The file system is full below the budget: lower the budget to what the files hold now and
        free ``ENOSPC_FREE_BLOCKS`` blocks' worth (module docstring)."""
        with self._lock:
            held = self._num_bytes
            if held == 0:  # the file system is full of others' files: no budget would free a byte here
                return
            lowered = held < self.effective_capacity_bytes
            is_first = lowered and self.effective_capacity_bytes == self.capacity_bytes
            self.effective_capacity_bytes = min(self.effective_capacity_bytes, held)
            effective = self.effective_capacity_bytes
        if is_first:  # once: later lowerings (the file system shrinking further) say no more than this
            log.warning("kv_tier_budget_lowered", directory=str(self.directory),
                        error=errno.errorcode.get(exc.errno, str(exc.errno)), capacity_bytes=self.capacity_bytes,
                        effective_capacity_bytes=effective, num_blocks=len(self._index),
                        reason="the file system is full below --kv-disk-bytes; least recently used blocks are "
                               "evicted to make room for new ones, within what it holds, until a restart")
        self._evict_until(ENOSPC_FREE_BLOCKS * size)

    # --- state --------------------------------------------------------------------------------

    def counters(self) -> TierCounters:
        with self._lock:
            return TierCounters(len(self._index), self._num_bytes, self.effective_capacity_bytes,
                                self._num_bytes_written, self._num_bytes_read, self._num_write_errors,
                                self._num_bad_files)

    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}{FILE_SUFFIX}"

    def _evict_until(self, num_new_bytes: int) -> None:
        """Removes least recently used files until ``num_new_bytes`` more fit the (effective) budget."""
        victims: list[bytes] = []
        with self._lock:
            while self._index and self._num_bytes + num_new_bytes > self.effective_capacity_bytes:
                key, size = self._index.popitem(last=False)
                self._num_bytes -= size
                victims.append(key)
        for key in victims:
            self._unlink(self._path(key))
            if self.on_change is not None:
                self.on_change(key, False)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._num_bytes -= size
        if size is not None and self.on_change is not None:
            self.on_change(key, False)

    def _remove_bad(self, path: Path, problem: str) -> None:
        with self._lock:
            self._num_bad_files += 1
        log.warning("kv_tier_file_removed", path=str(path), problem=problem)
        self._unlink(path)

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only directory: the file stays, and is checked again when read


_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
# Never follow a link, never wait: a FIFO opened for reading blocks until a writer comes, and one
# planted under a block's name held the tier's loader (and every later load) forever.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


LOCK_FILE_NAME = ".lock"


def _lock_directory(directory: Path) -> int:
    """An exclusive lock on the tier directory for this service's life (a descriptor to keep open).

    Two services on one directory kept two budgets over the same files (20 files against a 10-file
    budget), and a service for another model removed the other's files, half-written ones included,
    when it opened. The second now refuses to start, naming the directory and the holder.
    flock, not a pid file: the kernel releases it when the holder dies however it dies.
    """
    fd = os.open(directory / LOCK_FILE_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise PreconditionError(f"kv_disk_dir {str(directory)!r} is in use by another memory service (pid "
                                f"{holder}): give each service a directory of its own") from None
    try:  # the holder's pid, for the message above; a full disk (the service must still start) goes without
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    return fd


class NotOurFile(OSError):
    """A name in the tier directory that is no block file of ours: not a regular file, another user's,
    or linked from elsewhere (a hard link could make us serve, or later overwrite, a file we never wrote)."""


def open_own_file(path: str | Path):
    """A file of the tier directory (a block file, the service's id) opened for reading (unbuffered
    binary), only if it is a regular file of this process's user with one link; else NotOurFile. Never blocks: the
    open does not follow symlinks nor wait on a FIFO (and O_NONBLOCK does nothing to a regular file's
    reads)."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotOurFile("a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotOurFile(f"not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_uid != os.geteuid():
            raise NotOurFile(f"owned by uid {st.st_uid}, not {os.geteuid()}")
        if st.st_nlink != 1:
            raise NotOurFile(f"{st.st_nlink} links")
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _write_rest(fd: int, data: memoryview) -> None:
    """Writes all of ``data`` at the file's offset: a short write (a signal, a nearly full disk) goes on."""
    num_written = 0
    while num_written < len(data):
        num_written += os.write(fd, data[num_written:])


def _check_header(header: bytes, identity: TierIdentity, key: bytes, ns_key: bytes | None) -> str | None:
    """None when ``header`` is a sound header of ``identity``'s block ``key`` (in namespace ``ns_key``
    when given), else what is wrong."""
    if len(header) < HEADER_SIZE:
        return f"truncated header ({len(header)} bytes)"
    fields = header[: HEADER_FIELDS.size]
    if header[:8] != MAGIC:
        return "not a tier block (bad magic)"
    (version,) = struct.unpack_from("<H", header, 8)
    if version != LAYOUT_VERSION:
        return f"layout version {version}, this service reads {LAYOUT_VERSION}"
    if HEADER_CHECKSUM.unpack_from(header, HEADER_FIELDS.size)[0] != xxhash.xxh3_64_intdigest(fields):
        return "header checksum mismatch"
    (_, version, payload_offset, dtype, block_size, num_layers, num_kv_heads, head_dim, fingerprint, file_ns_key,
     file_key, payload_len, _) = HEADER_FIELDS.unpack(fields)
    if payload_offset != identity.payload_offset:
        return f"payload at {payload_offset}, expected {identity.payload_offset}"
    if fingerprint != identity.fingerprint_digest:
        return "another model (fingerprint differs)"
    file_dtype = dtype.rstrip(b"\0").decode(errors="replace")
    if file_dtype != identity.dtype:
        return f"another dtype ({file_dtype}, the pool's is {identity.dtype})"
    if block_size != identity.block_size:
        return f"another block size ({block_size}, the pool's is {identity.block_size})"
    if (num_layers, num_kv_heads, head_dim) != (identity.num_layers, identity.num_kv_heads, identity.head_dim):
        return f"another layout ({num_layers} layers, {num_kv_heads} KV heads, head dim {head_dim})"
    if file_key != key:
        return "its key differs from its name"
    if ns_key is not None and file_ns_key != ns_key:
        return "another namespace"
    if payload_len != identity.bytes_per_block:
        return f"payload of {payload_len} bytes, a block is {identity.bytes_per_block}"
    return None
