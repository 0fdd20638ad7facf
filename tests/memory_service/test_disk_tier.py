"""The disk tier's files: round trip, modes, warm restart, damaged and foreign files, budget, write errors."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from pagedserve.errors import PreconditionError

from memory_service.config import MemoryServiceConfig
from memory_service.manager.chain import BlockOrigin, chain_hashes, root_hash
from memory_service.tier.disk_tier import DIRECT_ALIGN, ENOSPC_FREE_BLOCKS, HEADER_SIZE, DiskTier, TierIdentity

pytestmark = pytest.mark.unit

IDENTITY = TierIdentity("model-a", "float32", 4, 2, 2, 4)  # 2 layers, 2 KV heads, head dim 4, 4 tokens a block
BLOCK_BYTES = IDENTITY.bytes_per_block  # 2 * 2 * 4 * 2 * 4 * 4 = 512
NS = bytes(range(16))
KEYS = chain_hashes(root_hash(IDENTITY.digest, NS), bytes(range(64)), 16, 4)


def payload(seed: int) -> memoryview:
    return memoryview(bytes((seed + i) % 256 for i in range(BLOCK_BYTES)))


def open_tier(directory: Path, capacity: int = 1 << 20, identity: TierIdentity = IDENTITY) -> DiskTier:
    tier = DiskTier(directory, capacity)
    tier.open(identity)
    return tier


def files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".kv"))


def test_round_trip_modes_and_warm_restart(tmp_path: Path) -> None:
    directory = tmp_path / "tier"
    tier = open_tier(directory)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    for i, key in enumerate(KEYS[:3]):
        assert tier.put(key, NS, payload(i))
    assert files(directory) == sorted(f"{key.hex()}.kv" for key in KEYS[:3])
    for name in files(directory):
        assert stat.S_IMODE(os.stat(directory / name).st_mode) == 0o600
    assert bytes(tier.get(KEYS[1], NS)) == bytes(payload(1))
    assert tier.get(KEYS[1], bytes(16)) is None  # another namespace: a miss, and a bad file
    assert [key in tier for key in KEYS[:3]] == [True, False, True]  # the namespace mismatch removed KEYS[1]

    tier.close()  # the service stops (its lock on the directory goes with it)
    restarted = open_tier(directory)  # a new service on the same directory
    assert [key in restarted for key in KEYS[:3]] == [True, False, True]
    assert bytes(restarted.get(KEYS[2], NS)) == bytes(payload(2))
    counters = restarted.counters()
    assert (counters.num_blocks, counters.num_bytes) == (2, 2 * (IDENTITY.file_size))


def test_a_restart_finds_each_blocks_origin_parents_first(tmp_path: Path) -> None:
    """Each file keeps its block's parent key and tokens: a new service on the directory hands the
    blocks back in chain order (its KV events announce them); a block whose parent's file is gone, one
    written without an origin and one whose origin does not chain to its key are served, never handed."""
    token_bytes = bytes(range(64))
    parents = [root_hash(IDENTITY.digest, NS), *KEYS[:3]]
    origins = [BlockOrigin(parent, token_bytes[16 * i:16 * (i + 1)]) for i, parent in enumerate(parents)]
    tier = open_tier(tmp_path / "tier")
    for i in (3, 1, 0, 2):  # the writer's order is not the chain's
        assert tier.put(KEYS[i], NS, payload(i), origins[i])
    assert tier.take_found() == []  # nothing was there before
    tier.close()
    restarted = open_tier(tmp_path / "tier")
    assert restarted.take_found() == [(KEYS[i], NS, origins[i]) for i in range(4)]
    assert restarted.take_found() == []  # handed once
    restarted.close()
    (tmp_path / "tier" / f"{KEYS[1].hex()}.kv").unlink()  # the chain breaks after its first block
    assert open_tier(tmp_path / "tier").take_found() == [(KEYS[0], NS, origins[0])]

    other = open_tier(tmp_path / "other")
    assert other.put(KEYS[0], NS, payload(0)) and other.put(KEYS[1], NS, payload(1), origins[0])  # none; not its own
    other.close()
    restarted = open_tier(tmp_path / "other")
    assert restarted.take_found() == [] and bytes(restarted.get(KEYS[1], NS)) == bytes(payload(1))


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "flip_header"])
def test_damaged_file_is_a_miss_and_removed(tmp_path: Path, damage: str) -> None:
    tier = open_tier(tmp_path)
    assert tier.put(KEYS[0], NS, payload(0))
    path = tmp_path / f"{KEYS[0].hex()}.kv"
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[IDENTITY.payload_offset + 100] ^= 1
    elif damage == "flip_header":
        data[20] ^= 1
    else:
        del data[-10:]
    path.write_bytes(data)
    assert tier.get(KEYS[0], NS) is None
    assert not path.exists()
    assert tier.counters().num_bad_files == 1
    assert KEYS[0] not in tier


@pytest.mark.parametrize("other", [
    TierIdentity("model-b", "float32", 4, 2, 2, 4),
    TierIdentity("model-a", "bfloat16", 4, 2, 2, 4),
    TierIdentity("model-a", "float32", 8, 2, 2, 4),
    TierIdentity("model-a", "float32", 4, 3, 2, 4),
])
def test_another_model_dtype_block_size_or_layout_is_removed_at_open(tmp_path: Path, other: TierIdentity) -> None:
    tier = open_tier(tmp_path)
    assert tier.put(KEYS[0], NS, payload(0))
    (tmp_path / ".tmp-leftover").write_bytes(b"cut short")  # a write a SIGKILL interrupted
    (tmp_path / "memory-service-id").write_text("not a block")  # not ours: left alone
    tier.close()
    reopened = open_tier(tmp_path, identity=other)
    assert files(tmp_path) == [] and reopened.counters().num_bad_files == 1
    assert sorted(os.listdir(tmp_path)) == [".lock", "memory-service-id"]


def test_truncated_file_is_removed_at_open(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    assert tier.put(KEYS[0], NS, payload(0)) and tier.put(KEYS[1], NS, payload(1))
    path = tmp_path / f"{KEYS[1].hex()}.kv"
    path.write_bytes(path.read_bytes()[: HEADER_SIZE + 7])
    tier.close()
    reopened = open_tier(tmp_path)
    assert KEYS[0] in reopened and KEYS[1] not in reopened and not path.exists()


def test_open_says_how_many_partial_writes_and_bad_files_it_removed(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    assert tier.put(KEYS[0], NS, payload(0)) and tier.put(KEYS[1], NS, payload(1))
    path = tmp_path / f"{KEYS[1].hex()}.kv"
    path.write_bytes(path.read_bytes()[: HEADER_SIZE + 7])  # truncated
    for name in (".tmp-a", ".tmp-b"):  # writes a SIGKILL cut short
        (tmp_path / name).write_bytes(b"cut short")
    tier.close()
    with capture_logs() as events:
        open_tier(tmp_path)
    by_event = {e["event"]: e for e in events}
    assert by_event["kv_tier_partial_writes_removed"]["num_files"] == 2
    assert by_event["kv_tier_partial_writes_removed"]["log_level"] == "warning"
    assert by_event["kv_tier_file_removed"]["path"] == str(path)
    opened = by_event["kv_tier_opened"]
    assert (opened["num_blocks"], opened["num_partial_writes_removed"], opened["num_bad_files_removed"]) == (1, 2, 1)
    assert files(tmp_path) == [f"{KEYS[0].hex()}.kv"]


def test_lru_within_the_budget(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, capacity=2 * (IDENTITY.file_size))
    assert tier.put(KEYS[0], NS, payload(0)) and tier.put(KEYS[1], NS, payload(1))
    assert tier.get(KEYS[0], NS) is not None  # KEYS[0] is now the most recently used
    assert tier.put(KEYS[2], NS, payload(2))
    assert [key in tier for key in KEYS[:3]] == [True, False, True]
    assert len(files(tmp_path)) == 2
    too_small = open_tier(tmp_path / "small", capacity=BLOCK_BYTES)  # a block never fits: dropped
    assert not too_small.put(KEYS[0], NS, payload(0))


def test_write_error_drops_the_block_and_goes_on(tmp_path: Path) -> None:
    directory = tmp_path / "tier"
    tier = open_tier(directory)
    assert tier.put(KEYS[0], NS, payload(0))
    # A real write error whoever runs the test (root ignores a read-only mode): the directory's path
    # turns into a plain file, so creating the temporary file fails (ENOTDIR).
    directory.rename(tmp_path / "away")
    directory.write_bytes(b"")
    try:
        assert not tier.put(KEYS[1], NS, payload(1))
        assert not tier.put(KEYS[2], NS, payload(2))
        assert tier.counters().num_write_errors == 2
    finally:
        directory.unlink()
        (tmp_path / "away").rename(directory)
    assert bytes(tier.get(KEYS[0], NS)) == bytes(payload(0))  # reads went on
    assert tier.put(KEYS[1], NS, payload(1))


PAGE = os.sysconf("SC_PAGE_SIZE")
MANY_KEYS = chain_hashes(root_hash(IDENTITY.digest, NS), bytes(range(256)), 16, 16)


@contextmanager
def mounted(directory: Path, fs_type: str, options: str, why: str) -> Iterator[Path]:
    """A file system of ``fs_type`` mounted on ``directory`` (made here) for the test's body, unmounted
    after; skips the test (saying ``why`` it needs one) where mounting is not permitted."""
    directory.mkdir()
    try:
        done = subprocess.run(["mount", "-t", fs_type, "-o", options, fs_type, str(directory)],
                              capture_output=True, text=True, timeout=30)
    except OSError as exc:
        pytest.skip(f"{why} needs a {fs_type} mount, and there is no mount command: {exc.strerror}")
    if done.returncode != 0:
        pytest.skip(f"{why} needs a {fs_type} mount, not permitted here: {done.stderr.strip()}")
    try:
        yield directory
    finally:
        if subprocess.run(["umount", str(directory)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=30)


def small_tmpfs(directory: Path, num_pages: int) -> contextlib.AbstractContextManager[Path]:
    """A tmpfs of ``num_pages`` pages: a file system that really fills (ENOSPC), where a block file
    takes one page."""
    return mounted(directory, "tmpfs", f"size={num_pages * PAGE},mode=0700", "a full file system")


def test_a_full_file_system_below_the_budget_evicts_lru_files_and_keeps_writing(tmp_path: Path) -> None:
    assert IDENTITY.file_size <= PAGE  # one page per block file
    with small_tmpfs(tmp_path / "fs", 9) as fs, capture_logs() as logs:  # 8 block files and the lock file
        tier = open_tier(fs / "tier", capacity=1 << 30)  # a budget far above the file system's 8 pages
        for i in range(8):
            assert tier.put(MANY_KEYS[i], NS, payload(i))
        assert tier.get(MANY_KEYS[0], NS) is not None  # the most recently used now: LRU order 1..7, 0
        with pytest.raises(OSError) as full:  # the file system really is full
            (fs / "probe").write_bytes(b"x" * PAGE)
        assert full.value.errno == errno.ENOSPC
        (fs / "probe").unlink(missing_ok=True)
        # The 9th block finds ENOSPC: the budget drops to the 8 files, the 4 least recently used go.
        assert tier.put(MANY_KEYS[8], NS, payload(8))
        assert ENOSPC_FREE_BLOCKS == 4
        assert files(fs / "tier") == sorted(f"{k.hex()}.kv" for k in (MANY_KEYS[0], *MANY_KEYS[5:9]))
        counters = tier.counters()
        assert counters.capacity_bytes == 8 * (IDENTITY.file_size)
        assert (counters.num_blocks, counters.num_write_errors) == (5, 0)
        # New blocks keep coming: three fit the room left, then each evicts the least recently used.
        for i in range(9, 14):
            assert tier.put(MANY_KEYS[i], NS, payload(i))
        assert files(fs / "tier") == sorted(f"{k.hex()}.kv" for k in (MANY_KEYS[0], *MANY_KEYS[7:14]))
        assert bytes(tier.get(MANY_KEYS[0], NS)) == bytes(payload(0))
        assert bytes(tier.get(MANY_KEYS[13], NS)) == bytes(payload(13))
        assert tier.counters().num_write_errors == 0
    lowered = [e for e in logs if e["event"] == "kv_tier_budget_lowered"]
    assert len(lowered) == 1 and lowered[0]["error"] == "ENOSPC"
    assert lowered[0]["effective_capacity_bytes"] == 8 * (IDENTITY.file_size)


def test_a_file_system_full_of_other_files_drops_the_block(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "fs", 4) as fs:
        tier = open_tier(fs / "tier", capacity=1 << 30)
        filler = fs / "other"
        with pytest.raises(OSError), open(filler, "wb") as f:  # someone else takes it all
            f.write(b"x" * 5 * PAGE)
        # ENOSPC, and no file of the tier's to evict: the retry fails too, the block is dropped.
        assert not tier.put(MANY_KEYS[0], NS, payload(0))
        assert files(fs / "tier") == [] and tier.counters().num_write_errors == 1
        filler.unlink()
        # Room again, and the budget was not lowered to the nothing the tier held: blocks accumulate.
        for i in range(1, 4):
            assert tier.put(MANY_KEYS[i], NS, payload(i))
        assert files(fs / "tier") == sorted(f"{k.hex()}.kv" for k in MANY_KEYS[1:4])
        assert tier.counters().capacity_bytes == 1 << 30


@pytest.mark.parametrize(("fields", "needle"), [
    ({"kv_disk_bytes": 0, "kv_disk_dir": "/x"}, "kv_disk_bytes must be >= 1"),
    ({"kv_disk_bytes": 1 << 20}, "kv_disk_bytes needs kv_disk_dir"),
    ({"kv_disk_dir": "/x", "enable_prefix_caching": False}, "needs enable_prefix_caching"),
])
def test_config_checks_the_tier_flags(fields: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        MemoryServiceConfig(**fields)


def test_a_directory_path_that_is_a_file_fails_the_start(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(PreconditionError, match="kv_disk_dir"):
        DiskTier(tmp_path / "file", 1 << 20)


# A block of whole pages (2 layers, 2 KV heads, head dim 32, 4 tokens, float32: 4,096 bytes), as every
# real model's is: its file is a page of header, then the payload, written with O_DIRECT.
PAGE_IDENTITY = TierIdentity("model-a", "float32", 4, 2, 2, 32)
PAGE_KEYS = chain_hashes(root_hash(PAGE_IDENTITY.digest, NS), bytes(range(64)), 16, 4)


def page_payload(seed: int) -> memoryview:
    return memoryview(bytes((seed * 7 + i) % 251 for i in range(PAGE_IDENTITY.bytes_per_block)))


def resident_pages(path: Path) -> int:
    """How many of the file's pages the page cache holds: mincore over a mapping (which reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(-(-size // PAGE))
            assert libc.mincore(address, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def test_a_block_of_whole_pages_is_written_past_the_page_cache(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, identity=PAGE_IDENTITY)
    with capture_logs() as logs:
        assert tier.put(PAGE_KEYS[0], NS, page_payload(0))
    path = tmp_path / f"{PAGE_KEYS[0].hex()}.kv"
    data = path.read_bytes()  # (this read fills the page cache)
    assert len(data) == PAGE_IDENTITY.file_size == 2 * DIRECT_ALIGN  # a page of header, a page of payload
    assert data[HEADER_SIZE:DIRECT_ALIGN] == bytes(DIRECT_ALIGN - HEADER_SIZE)
    assert data[DIRECT_ALIGN:] == bytes(page_payload(0))
    assert bytes(tier.get(PAGE_KEYS[0], NS)) == bytes(page_payload(0))
    assert tier.put(PAGE_KEYS[1], NS, page_payload(1))
    if "tmpfs" not in subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True,
                                     text=True).stdout:  # tmpfs files are the page cache itself
        assert resident_pages(tmp_path / f"{PAGE_KEYS[1].hex()}.kv") == 0  # O_DIRECT: no copy in RAM
    assert [e["event"] for e in logs if e["event"].startswith("kv_tier_direct")] == []
    damaged = bytearray(data)
    damaged[DIRECT_ALIGN + 5] ^= 1
    path.write_bytes(damaged)
    assert tier.get(PAGE_KEYS[0], NS) is None and not path.exists()  # the checksum covers the payload


def test_a_file_system_without_direct_io_gets_buffered_writes(tmp_path: Path) -> None:
    with mounted(tmp_path / "ramfs", "ramfs", "mode=0700", "a file system without O_DIRECT") as directory:
        tier = open_tier(directory / "tier", identity=PAGE_IDENTITY)
        with capture_logs() as logs:
            for i in range(3):
                assert tier.put(PAGE_KEYS[i], NS, page_payload(i))
        assert [e["event"] for e in logs] == ["kv_tier_direct_io_off"]  # said once
        assert files(directory / "tier") == sorted(f"{k.hex()}.kv" for k in PAGE_KEYS[:3])  # no temporary left
        assert [bytes(tier.get(k, NS)) for k in PAGE_KEYS[:3]] == [bytes(page_payload(i)) for i in range(3)]
        assert tier.counters().num_write_errors == 0


def test_a_file_of_the_first_layout_is_removed_at_open(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    assert tier.put(KEYS[0], NS, payload(0))
    path = tmp_path / f"{KEYS[0].hex()}.kv"
    data = bytearray(path.read_bytes())
    data[8:10] = (1).to_bytes(2, "little")  # layout 1: CRC-32 checksums, another header
    path.write_bytes(data)
    tier.close()
    with capture_logs() as logs:
        reopened = open_tier(tmp_path)
    assert KEYS[0] not in reopened and not path.exists()
    assert [e["problem"] for e in logs if e["event"] == "kv_tier_file_removed"] == [
        "layout version 1, this service reads 3"]


@pytest.mark.parametrize("plant", ["fifo", "hard_link", "symlink"])
def test_a_name_that_is_no_block_file_of_ours_is_a_quick_miss_and_removed(tmp_path: Path, plant: str) -> None:
    """A FIFO under a block's name hung the loader (and every later load) in
    open(); a hard-linked or symlinked file was served. Each is now a miss at once, and removed."""
    tier = open_tier(tmp_path / "tier")
    assert tier.put(KEYS[0], NS, payload(0)) and tier.put(KEYS[1], NS, payload(1))
    path = tmp_path / "tier" / f"{KEYS[0].hex()}.kv"
    elsewhere = tmp_path / "elsewhere.kv"
    os.replace(path, elsewhere)  # the real bytes, now outside
    if plant == "fifo":
        os.mkfifo(path, 0o600)
    elif plant == "hard_link":
        os.link(elsewhere, path)
    else:
        path.symlink_to(elsewhere)
    assert tier.get(KEYS[0], NS) is None  # returns (a FIFO blocked here forever)
    assert not os.path.lexists(path) and KEYS[0] not in tier and tier.counters().num_bad_files == 1
    assert bytes(tier.get(KEYS[1], NS)) == bytes(payload(1))  # the tier goes on serving
    if plant == "hard_link":  # and at the next open, a planted link is removed rather than indexed
        os.link(tmp_path / "tier" / f"{KEYS[1].hex()}.kv", tmp_path / "other-link")
        tier.close()
        assert open_tier(tmp_path / "tier").counters().num_blocks == 0


def test_a_second_service_on_the_same_directory_refuses_to_start(tmp_path: Path) -> None:
    """Two services on one directory kept two budgets over the same files, and one for
    another model removed the other's files when it opened. The second refuses, naming both."""
    tier = open_tier(tmp_path / "tier")
    assert tier.put(KEYS[0], NS, payload(0))
    other = TierIdentity("model-b", "float32", 4, 2, 2, 4)
    done = subprocess.run([sys.executable, "-c", (
        "import sys; from memory_service.tier.disk_tier import DiskTier\n"
        f"DiskTier({str(tmp_path / 'tier')!r}, 1 << 20)")], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"kv_disk_dir '{tmp_path / 'tier'}' is in use by another memory service (pid {os.getpid()})" in done.stderr
    assert files(tmp_path / "tier") == [f"{KEYS[0].hex()}.kv"]  # nothing of the first service's was touched
    tier.close()
    reopened = open_tier(tmp_path / "tier", identity=other)  # once it stops, the directory is free
    assert files(tmp_path / "tier") == [] and reopened.counters().num_bad_files == 1


def test_a_read_only_file_system_is_a_clear_refusal(tmp_path: Path) -> None:
    """A tier directory on a read-only file system crashed the start with an
    uncaught error. Now the service refuses to start with a message naming the flag."""
    with mounted(tmp_path / "ro", "tmpfs", "ro,size=65536,mode=0700", "a read-only file system") as mount_point:
        with pytest.raises(PreconditionError, match=r"kv_disk_dir .*: Read-only file system: the disk tier needs a "
                                                    r"directory it can write \(or leave --kv-disk-dir out\)"):
            DiskTier(mount_point, 1 << 20)
