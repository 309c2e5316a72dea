"""Streams batches through cuferry's slot ring from Python via ctypes (run by
tests/python_ctypes.rs), the way a replay loader feeds a learner.

Usage: python3 ring_ctypes.py LIBCUFERRY_SO DEVICE   (DEVICE -1: host backend)

A producer thread publishes batches with cuferry_ring_produce (pipelined, from Python bytes) and
by hand (acquire, write, publish); the main thread consumes them in order and checks every
byte: on the host backend from the item's memory, on CUDA by copying it out with CuPy (SKIP of
the byte check, not of the protocol, when CuPy is missing). Exits non-zero on failure.
"""
import ctypes
import sys
import threading

lib = ctypes.CDLL(sys.argv[1])
device = int(sys.argv[2])
OK, WOULD_BLOCK, CLOSED = 0, 6, 8
vp, u64, size_t, i64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64

lib.cuferry_last_error_message.restype = ctypes.c_char_p
signatures = {
    "cuferry_stream_create": [ctypes.c_int32, ctypes.POINTER(vp)],
    "cuferry_stream_synchronize": [vp],
    "cuferry_stream_destroy": [vp],
    "cuferry_ring_create": [ctypes.c_int32, size_t, size_t, size_t, ctypes.POINTER(vp)],
    "cuferry_ring_destroy": [vp],
    "cuferry_ring_close": [vp],
    "cuferry_ring_acquire": [vp, i64, ctypes.POINTER(vp), ctypes.POINTER(vp)],
    "cuferry_ring_publish": [vp, u64, size_t],
    "cuferry_ring_produce": [vp, ctypes.POINTER(u64), ctypes.POINTER(vp), ctypes.POINTER(size_t), size_t,
                             size_t],
    "cuferry_ring_next": [vp, vp, i64, ctypes.POINTER(vp)],
    "cuferry_ring_item_info": [vp, ctypes.POINTER(vp), ctypes.POINTER(u64), ctypes.POINTER(size_t)],
    "cuferry_ring_release": [vp],
}
for name, args in signatures.items():
    getattr(lib, name).argtypes = args
    getattr(lib, name).restype = ctypes.c_int


def ok(status):
    if status != OK:
        raise SystemExit(f"cuferry call failed ({status}): {lib.cuferry_last_error_message().decode()}")


SLOT = 256 << 10
DEPTH = 3
PIPELINED = 24  # items published by cuferry_ring_produce
BY_HAND = 6  # then by acquire / publish


def batch(seq):
    """The bytes of item `seq`: its own length and pattern."""
    n = 1 + (seq * 40009) % SLOT
    return bytes((i * (seq + 3) + seq) % 251 for i in range(n))


def read_back(address, n):
    """The item's bytes on the host, or None when they cannot be read here."""
    if device < 0:
        return ctypes.string_at(address, n)
    try:
        import cupy
    except ImportError:
        return None
    out = bytearray(n)
    host = (ctypes.c_char * n).from_buffer(out)
    cupy.cuda.runtime.memcpy(ctypes.addressof(host), address, n, cupy.cuda.runtime.memcpyDeviceToHost)
    return bytes(out)


ring, stream = vp(), vp()
ok(lib.cuferry_ring_create(device, DEPTH, SLOT, 4, ctypes.byref(ring)))
ok(lib.cuferry_stream_create(device, ctypes.byref(stream)))
errors = []


def produce():
    try:
        # Pipelined: the sources stay alive (and unchanged) for the whole call.
        sources = [ctypes.create_string_buffer(batch(s), len(batch(s))) for s in range(PIPELINED)]
        seqs = (u64 * PIPELINED)(*range(PIPELINED))
        ptrs = (vp * PIPELINED)(*(ctypes.addressof(s) for s in sources))
        lens = (size_t * PIPELINED)(*(len(s) for s in sources))
        ok(lib.cuferry_ring_produce(ring, seqs, ptrs, lens, PIPELINED, DEPTH))
        for seq in range(PIPELINED, PIPELINED + BY_HAND):
            data = batch(seq)
            slot, host = vp(), vp()
            ok(lib.cuferry_ring_acquire(ring, -1, ctypes.byref(slot), ctypes.byref(host)))
            ctypes.memmove(host, data, len(data))
            ok(lib.cuferry_ring_publish(slot, seq, len(data)))
        ok(lib.cuferry_ring_close(ring))
    except BaseException as e:  # reported by the main thread
        errors.append(e)
        lib.cuferry_ring_close(ring)


producer = threading.Thread(target=produce, daemon=True)
producer.start()
received, checked = 0, 0


def consume_one():
    """Takes, checks and releases the next item; False once the ring is closed and drained."""
    global received, checked
    item = vp()
    status = lib.cuferry_ring_next(ring, stream, 20_000_000, ctypes.byref(item))
    if status == CLOSED:
        return False
    ok(status)
    address, seq, n = vp(), u64(), size_t()
    ok(lib.cuferry_ring_item_info(item, ctypes.byref(address), ctypes.byref(seq), ctypes.byref(n)))
    assert seq.value == received, f"FIFO order: got {seq.value}, expected {received}"
    want = batch(received)
    assert n.value == len(want), f"item {received}: {n.value} bytes, expected {len(want)}"
    ok(lib.cuferry_stream_synchronize(stream))
    got = read_back(address.value, n.value)
    if got is not None:
        assert got == want, f"item {received}: bytes differ"
        checked += 1
    ok(lib.cuferry_ring_release(item))
    received += 1
    return True


try:
    while consume_one():
        pass
except BaseException:
    lib.cuferry_ring_close(ring)  # the producer stops with CLOSED instead of waiting forever
    raise
producer.join()
if errors:
    raise errors[0]
assert received == PIPELINED + BY_HAND, f"received {received} items"
item = vp()
assert lib.cuferry_ring_next(ring, stream, 0, ctypes.byref(item)) == CLOSED
ok(lib.cuferry_ring_destroy(ring))
ok(lib.cuferry_stream_destroy(stream))
if checked < received:
    print(f"SKIP: bytes of {received - checked} items not checked (no CuPy to read device memory)")
print(f"python ring passed: {received} items in order, {checked} byte-checked")
