"""Halo packing and managed memory from Python through python/cuferry.py (run by
tests/python_ctypes.rs).

Usage: python3 halo_managed_ctypes.py LIBCUFERRY_SO DEVICE   (DEVICE -1: host backend)

Halo: two arrays (a contiguous uint32 grid, and a padded uint32 grid whose exchange turns a
quarter clockwise) packed, looped back and unpacked through device buffers; every element,
padding included, is compared with a plain loop written here. On the host backend the packed
bytes are read and the unpack buffer filled by hand, as a receive would. Bad descriptions
raise ValueError before the library, or the library's message. Managed memory: allocation,
pool counters, prefetch (single and batched), advice, and the errors for bad locations,
advice and ranges, on the pool the device's first use makes (on CUDA a managed memory pool,
whose advice the driver may refuse: exactly that refusal is accepted there). Then, since a
device's pool is made once per process, the script runs itself again with a third argument,
`configured`: that process configures the pool first (`managed_pool_configure`, with
`use_malloc_managed` and a size limit) and checks that every advice is taken there, and the
limit kept. Exits non-zero on failure.
"""
import ctypes
import os
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import cuferry  # noqa: E402

lib = cuferry.load(sys.argv[1])
device = int(sys.argv[2])
HOST = device == cuferry.HOST
CONFIGURED = sys.argv[3:] == ["configured"]


def raises(kind, call, text=""):
    """Runs `call`; it must raise `kind` with `text` in its message."""
    try:
        call()
    except kind as e:
        assert text in str(e), f"{e!r} does not mention {text!r}"
        return e
    raise AssertionError(f"{call} did not raise {kind.__name__}")


def configured_pool():
    """The child process: the device's pool configured before any other managed call, as
    cudaMallocManaged allocations with a size limit (on HOST only the limit counts). Every
    advice must be taken there, and the limit kept."""
    limit, n = 8 << 20, 1 << 20
    lib.managed_pool_configure(device, use_malloc_managed=True, max_size=limit)
    lib.managed_pool_configure(device, use_malloc_managed=True, max_size=limit)  # the same: OK
    kind = lib.pool_kind(device)
    assert kind == ("host" if HOST else "malloc_managed"), kind
    e = raises(cuferry.CuferryError, lambda: lib.managed_pool_configure(device, max_size=2 * limit),
               "already exists")
    assert e.name == "CUFERRY_STATUS_INVALID_ARGUMENT", e
    assert ("host memory" if HOST else "cudaMallocManaged") in e.message, e.message
    here = "host" if HOST else device
    with lib.stream(device) as stream, lib.managed_alloc(device, n, stream) as m:
        lib.prefetch(m, n, here, stream)
        for advice, where in (("set_read_mostly", None), ("unset_read_mostly", None),
                              ("set_preferred_location", "host"), ("set_preferred_location", here),
                              ("unset_preferred_location", None), ("set_accessed_by", here),
                              ("unset_accessed_by", here)):
            lib.advise(m, n, advice, where)  # no refusal accepted on this pool
        lib.prefetch(m, n, "host", stream)
        stream.synchronize()
        if HOST:
            ctypes.memmove(m.ptr, b"configured", 10)
            assert ctypes.string_at(m.ptr, 10) == b"configured"
        assert lib.pool_stats(device)["used_current"] == n, lib.pool_stats(device)
        # Past the limit: refused at once, as an allocation out of memory is.
        e = raises(cuferry.OutOfMemory, lambda: lib.managed_alloc(device, limit, stream), "at most")
        assert isinstance(e, cuferry.AllocationFailed) and e.name == "CUFERRY_STATUS_OUT_OF_MEMORY", e
    print("python managed (configured pool) passed")


if CONFIGURED:
    configured_pool()
    sys.exit(0)


# ---- halo ----------------------------------------------------------------------------------

# A: 6 rows (y) x 8 columns (x) of uint32, contiguous. Row 1 is packed and lands in row 5.
A_ROWS, A_COLS = 6, 8
a = [1000 + i for i in range(A_ROWS * A_COLS)]
# B: 5 x 5 uint32 rows (a packer's exchanges share one element size) 7 elements apart (2 of padding). Rows 0..2, columns 2..5 (2 x 3) are
# packed turned a quarter clockwise (3 x 2) and land in rows 2..5, columns 0..2.
B_N, B_STRIDE = 5, 7
b_len = (B_N - 1) * B_STRIDE + B_N
b = [(7 * i + 3) % 65536 for i in range(b_len)]

exchanges = [
    cuferry.HaloExchange(4, [A_ROWS, A_COLS], pack=[range(1, 2), range(0, A_COLS)],
                         unpack=[slice(5, 6), (0, A_COLS)], y_dim=0, x_dim=1),
    cuferry.HaloExchange(4, [B_N, B_N], strides=[B_STRIDE, 1], pack=[(0, 2), (2, 5)],
                         unpack=[(2, 5), (0, 2)], y_dim=0, x_dim=1, rotation=1),
]

# The reference, element by element. A quarter turn: result (x=i, y=j) is source
# (x = nx-1-j, y = i) of the packed region, nx its x extent (src/halo/spec.rs rules).
a_want = list(a)
for x in range(A_COLS):
    a_want[5 * A_COLS + x] = a[1 * A_COLS + x]
b_want = list(b)
nx = 3
for row in range(3):  # result y
    for col in range(2):  # result x
        src_y, src_x = col, nx - 1 - row
        b_want[(2 + row) * B_STRIDE + (0 + col)] = b[(0 + src_y) * B_STRIDE + (2 + src_x)]
assert a_want != a and b_want != b, "the exchanges change both arrays"

a_bytes, b_bytes = struct.pack(f"<{len(a)}I", *a), struct.pack(f"<{len(b)}I", *b)
with lib.stream(device) as stream, lib.halo_packer(device, exchanges) as packer, \
        lib.device_buffer(stream, len(a_bytes)) as dev_a, lib.device_buffer(stream, len(b_bytes)) as dev_b, \
        lib.pinned(device, len(a_bytes)) as host_a, lib.pinned(device, len(b_bytes)) as host_b:
    host_a.write(a_bytes)
    host_b.write(b_bytes)
    lib.copy(stream, host_a, dev_a, len(a_bytes))
    lib.copy(stream, host_b, dev_b, len(b_bytes))
    # Each call is ordered after cuferry's earlier work on the buffers: no waits in between.
    packer.pack([dev_a, dev_b])
    packer.loopback()
    packer.unpack([dev_a, dev_b])
    lib.copy(stream, dev_a, host_a, len(a_bytes))
    lib.copy(stream, dev_b, host_b, len(b_bytes))
    got_a = list(struct.unpack(f"<{len(a)}I", host_a.read()))
    got_b = list(struct.unpack(f"<{len(b)}I", host_b.read()))
    assert got_a == a_want, f"array A after the exchange: {got_a}"
    assert got_b == b_want, f"array B after the exchange (padding included): {got_b}"

    ptr, nbytes = packer.pack_buffer()
    assert ptr and nbytes >= (8 + 6) * 4, (ptr, nbytes)
    assert packer.unpack_buffer()[1] == nbytes, "pack and unpack buffers have one size"
    if HOST:
        # A receive by hand: row 1 of A packed first, then overwritten and unpacked.
        packed = packer.read_packed()
        assert packed[:32] == a_bytes[32:64], "A's row 1 leads the pack buffer"
        raises(ValueError, lambda: packer.write_unpack(b"\0"), "unpack buffer")
        packer.write_unpack(bytes(range(256)) * (nbytes // 256) + bytes(range(nbytes % 256)))
        packer.unpack([dev_a, dev_b])
        row5 = struct.unpack("<8I", dev_a.read(32, offset=5 * A_COLS * 4))
        assert row5 == struct.unpack("<8I", bytes(range(32))), row5
    else:
        raises(ValueError, packer.read_packed, "device memory")
    # Wrong arguments: the library names the problem; the packer stays usable.
    raises(cuferry.CuferryError, lambda: packer.pack([dev_a]), "")
    if HOST:
        # Host memory is the host packer's to reach: a pinned buffer and a wrapped bytearray
        # pack as the device buffers with the same bytes do.
        packer.pack([dev_a, dev_b])
        want = packer.read_packed()
        own_b = bytearray(len(b_bytes))
        lib.copy(stream, dev_b, host_b, len(b_bytes))
        with lib.wrap(device, own_b) as wrapped_b:
            lib.copy(stream, dev_b, wrapped_b, len(b_bytes))
            for arrays in ([dev_a, host_b], [dev_a, wrapped_b]):
                packer.pack(arrays)
                assert packer.read_packed() == want, "a host array packs differently"
    else:
        raises(cuferry.CuferryError, lambda: packer.pack([dev_a, host_b]), "device or managed memory")
    packer.pack([dev_a, dev_b])
    packer.synchronize()

# Descriptions refused before the library (ctypes would wrap or overflow them) ...
raises(ValueError, lambda: lib.halo_packer(device, [cuferry.HaloExchange(4, [8] * 7, [(0, 1)] * 7, [(0, 1)] * 7)]),
       "1 to 6 dims")
raises(ValueError, lambda: lib.halo_packer(device, [cuferry.HaloExchange(4, [8], [(0, -1)], [(0, 1)])]), ">= 0")
raises(ValueError, lambda: lib.halo_packer(device, [cuferry.HaloExchange(4, [8, 8], [(0, 1)], [(0, 1)] * 2)]),
       "pack has 1 entries")
raises(ValueError, lambda: cuferry.HaloExchange(4, [8], [range(0, 8, 2)], [(0, 4)]), "step 1")
raises(ValueError, lambda: lib.halo_packer(device, [cuferry.HaloExchange(4, [8], [(0, 1)], [(0, 1)], x_dim=1)]),
       "x_dim")
raises(ValueError, lambda: lib.halo_packer(device, [cuferry.HaloExchange(2**32 + 4, [8], [(0, 1)], [(1, 2)])]),
       "below 2**32")
raises(ValueError, lambda: lib.halo_packer(device, [cuferry.HaloExchange(4, [2**64 + 8], [(0, 1)], [(1, 2)])]),
       "below 2**64")
raises(ValueError, lambda: lib.halo_packer(device, [cuferry.HaloExchange(4, [8], [(0, 1)], [(1, 2)], x_dim=True)]),
       "x_dim")
# ... and by the library, with its message.
e = raises(cuferry.CuferryError, lambda: lib.halo_packer(
    device, [cuferry.HaloExchange(4, [8, 8], [(0, 2), (0, 8)], [(6, 8), (0, 4)])]))
assert e.name == "CUFERRY_STATUS_INVALID_ARGUMENT" and e.message, e
raises(cuferry.CuferryError, lambda: lib.halo_packer(device, [cuferry.HaloExchange(65, [8], [(0, 1)], [(1, 2)])]),
       "element_size")
raises(cuferry.CuferryError, lambda: lib.halo_packer(device, [
    cuferry.HaloExchange(4, [8], [(0, 1)], [(1, 2)]), cuferry.HaloExchange(2, [8], [(0, 1)], [(1, 2)])]),
    "one element type")

# ---- managed memory ------------------------------------------------------------------------

kind = lib.pool_kind(device)  # the device's first managed call: its pool, with the defaults
assert kind in (("host",) if HOST else ("managed_pool", "malloc_managed")), kind
# The pool exists now: configuring it with its options succeeds, with others it is refused,
# naming the pool (on HOST the flags are ignored, only a size limit differs).
lib.managed_pool_configure(device)
if HOST:
    lib.managed_pool_configure(device, use_malloc_managed=True, prefer_device=False)
    e = raises(cuferry.CuferryError, lambda: lib.managed_pool_configure(device, max_size=1 << 20), "already exists")
    assert "host memory" in e.message, e.message
else:
    e = raises(cuferry.CuferryError, lambda: lib.managed_pool_configure(device, use_malloc_managed=True),
               "already exists")
    named = {"managed_pool": "a CUDA managed memory pool", "malloc_managed": "cudaMallocManaged"}[kind]
    assert named in e.message, e.message
assert e.name == "CUFERRY_STATUS_INVALID_ARGUMENT", e
raises(ValueError, lambda: lib.managed_pool_configure(device, use_malloc_managed=1), "not a bool")
raises(ValueError, lambda: lib.managed_pool_configure(device, max_size=-1), "unsigned")
raises(ValueError, lambda: lib.managed_pool_configure(2**32 - 1), "signed 32-bit")
e = raises(cuferry.CuferryError, lambda: lib.managed_pool_configure(-2), "-2")
assert e.name == "CUFERRY_STATUS_INVALID_ARGUMENT", e


def advise(ptr, nbytes, advice, where=None):
    """`lib.advise`, allowing exactly one refusal: UNSUPPORTED on the memory of a CUDA managed
    memory pool, whose driver may refuse advice (the H100's driver 580.159 does); the message
    names the way out from Python. True when the advice was taken."""
    try:
        lib.advise(ptr, nbytes, advice, where)
        return True
    except cuferry.CuferryError as e:
        if not (kind == "managed_pool" and e.name == "CUFERRY_STATUS_UNSUPPORTED"
                and "managed memory pool" in e.message and "managed_pool_configure" in e.message):
            raise
        return False


N = 1 << 20
with lib.stream(device) as stream:
    before = lib.pool_stats(device)
    with lib.managed_alloc(device, N, stream) as m:
        assert m.ptr and m.size == N
        during = lib.pool_stats(device)
        assert during["used_current"] >= before["used_current"] + N, (before, during)
        assert during["used_high"] >= during["used_current"]
        here = "host" if HOST else device
        lib.prefetch(m, N, here, stream)
        lib.prefetch_batch([(m, N // 2), (m.ptr + N // 2, N // 2)], here, stream)
        lib.prefetch_batch([], here, stream)
        advise(m, N, "set_read_mostly")
        advise(m, N, "unset_read_mostly")
        advise(m, N, "set_preferred_location", "host")
        advise(m, N, "unset_preferred_location")
        if HOST:
            # Host-pool memory is plain host memory: it stays readable where it was written.
            ctypes.memmove(m.ptr, b"cuferry", 7)
            assert ctypes.string_at(m.ptr, 7) == b"cuferry"
            e = raises(cuferry.CuferryError, lambda: lib.prefetch(m, N, 0, stream), "cuda:0")
            assert e.name == "CUFERRY_STATUS_UNSUPPORTED", e
        else:
            advise(m, N, "set_accessed_by", device)
            advise(m, N, "unset_accessed_by", device)
            lib.prefetch(m, N, "host", stream)
            stream.synchronize()
        # Errors: a range past the allocation, an advice needing a location without one, bad
        # names, and negative sizes.
        raises(cuferry.CuferryError, lambda: lib.prefetch(m, N + 1, here, stream), "past the end")
        raises(ValueError, lambda: lib.advise(m, N, "set_accessed_by"), "pass where=")
        raises(ValueError, lambda: lib.advise(m, N, "set_read_mostly", "host"), "names no location")
        raises(cuferry.CuferryError, lambda: lib.advise(m, N, "set_accessed_by", ("numa", 0)), "NUMA")
        raises(ValueError, lambda: lib.advise(m, N, "read_mostly"), "set_read_mostly")
        raises(ValueError, lambda: lib.prefetch(m, N, "gpu", stream), "location")
        raises(ValueError, lambda: lib.prefetch(m, N, -2, stream), "location")
        raises(ValueError, lambda: lib.prefetch(m, -1, here, stream), "unsigned")
        raises(ValueError, lambda: lib.prefetch_batch([(m, -1)], here, stream), "unsigned")
        raises(ValueError, lambda: lib.prefetch(m, N, here, "stream"), "stream")
        # Numbers ctypes would wrap to small ones, and bools, are refused before the call.
        raises(ValueError, lambda: lib.prefetch(m, 2**64 + 8, here, stream), "below 2**64")
        raises(ValueError, lambda: lib.prefetch_batch([(m, 2**64 + 8)], here, stream), "below 2**64")
        raises(ValueError, lambda: lib.prefetch(m, True, here, stream), "unsigned integer")
        raises(ValueError, lambda: lib.prefetch(m, N, here, 2**64 + 1), "stream")
        # A handle of another class where a stream goes (as everywhere else: TypeError).
        with lib.pinned(device, 16) as not_a_stream:
            raises(TypeError, lambda: lib.prefetch(m, N, here, not_a_stream), "where a Stream goes")
            raises(TypeError, lambda: lib.managed_alloc(device, 16, not_a_stream), "where a Stream goes")
        raises(ValueError, lambda: lib.prefetch(m, N, ("numa", True), stream), "location")
        stream.synchronize()
    stream.synchronize()  # the free is queued on the stream; the driver counts it once run
    after = lib.pool_stats(device)
    assert after["used_current"] == before["used_current"], (before, after)
    raises(ValueError, lambda: lib.prefetch(m, N, "host"), "after free")
    m.free()  # idempotent
    raises(ValueError, lambda: lib.managed_alloc(device, 0), "at least one")
    raises(ValueError, lambda: lib.managed_alloc(device, 2**64 + 16), "below 2**63")
    raises(ValueError, lambda: lib.managed_alloc(device, -1), "unsigned")
    # A device number no C int holds (2**32 - 1 wrapped to -1, the host pool) or a bool.
    raises(ValueError, lambda: lib.managed_alloc(2**32 - 1, 16), "signed 32-bit")
    raises(ValueError, lambda: lib.managed_alloc(True, 16), "integer")
    raises(cuferry.CuferryError, lambda: lib.prefetch(0x1000, 64, "host", stream), "not inside managed memory")
    if HOST:
        # The allocator pair reports a failure as NULL, the last error message and its status.
        e = raises(cuferry.ManagedOutOfMemory, lambda: lib.managed_alloc(device, 1 << 62), "")
        assert e.name == "CUFERRY_STATUS_OUT_OF_MEMORY" and e.status == lib.const.CUFERRY_STATUS_OUT_OF_MEMORY, e
        assert e.message and isinstance(e, cuferry.OutOfMemory), e
        # HOST names the host as a location too, so device-generic code runs on the host backend.
        with lib.managed_alloc(device, 4096) as small:
            lib.prefetch(small, 4096, cuferry.HOST)
            lib.advise(small, 4096, "set_preferred_location", cuferry.HOST)
# An allocation outliving the Stream it was made on is freed (on the legacy default stream, the
# stream's work waited for when it was freed), and counted freed.
stream = lib.stream(device)
before = lib.pool_stats(device)["used_current"]
late = lib.managed_alloc(device, 4096, stream)
stream.free()
late.free()
# The free is queued on the legacy default stream (nothing here waits for it): poll.
deadline = time.monotonic() + 5
while lib.pool_stats(device)["used_current"] != before and time.monotonic() < deadline:
    time.sleep(0.01)
assert lib.pool_stats(device)["used_current"] == before, "the allocation outliving its stream stayed allocated"

# Advice that takes effect: a process of its own, whose pool is configured before first use.
child = subprocess.run([sys.executable, os.path.abspath(__file__), sys.argv[1], str(device), "configured"],
                       capture_output=True, text=True, timeout=300)
print(child.stdout + child.stderr, end="")
assert child.returncode == 0 and "configured pool) passed" in child.stdout, "the configured-pool run failed"

print("python halo and managed passed")
