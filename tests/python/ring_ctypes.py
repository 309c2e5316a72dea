"""Streams batches through cuferry's slot ring from Python with python/cuferry.py (run by
tests/python_ctypes.rs), the way a replay loader feeds a learner.

Usage: python3 ring_ctypes.py LIBCUFERRY_SO DEVICE   (DEVICE -1: host backend)

A producer thread publishes batches with Ring.produce (pipelined, from Python bytes) and by
hand (acquire, write, publish; one slot abandoned); the main thread consumes them in order and
checks every byte: on the host backend from the item's memory after synchronizing the item's
stream; on CUDA as a consumer kernel would, with CuPy: a device copy of the item queued on the
item's stream (`Stream.cuda_handle`), the item released at once, and the copies compared after
the last item (the release must keep each slot's next upload behind its copy). Without CuPy
the byte check is skipped, not the protocol. Then a produce with a timeout and no consumer
gives up with its published count, and resumes from it. Then a ring freed
while a consumer waits in `next`: the consumer gets Closed; and a call made between free()'s
wait and the destroy raises Closed without reaching the C ring. Exits non-zero on failure.
"""
import ctypes
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import cuferry  # noqa: E402

lib = cuferry.load(sys.argv[1])
device = int(sys.argv[2])

SLOT = 256 << 10
DEPTH = 3
PIPELINED = 24  # items published by Ring.produce
BY_HAND = 6  # then by acquire / publish


def batch(seq):
    """The bytes of item `seq`: its own length and pattern."""
    n = 1 + (seq * 40009) % SLOT
    return bytes((i * (seq + 3) + seq) % 251 for i in range(n))


try:
    import cupy
except ImportError:
    cupy = None


def take(item):
    """The item's bytes on the host backend (after synchronizing its stream); on CUDA a CuPy
    copy queued on the item's stream, not waited for; None when CuPy is missing."""
    if device < 0:
        stream.synchronize()
        return ctypes.string_at(item.ptr, item.nbytes)
    if cupy is None:
        return None
    with cupy.cuda.ExternalStream(stream.cuda_handle) as on_item_stream:
        out = cupy.empty(item.nbytes, dtype=cupy.uint8)
        cupy.cuda.runtime.memcpyAsync(
            out.data.ptr, item.ptr, item.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, on_item_stream.ptr
        )
    return out


ring = lib.ring(device, DEPTH, SLOT, fill_threads=4)
stream = lib.stream(device)
errors = []


def produce():
    try:
        ring.produce(((s, batch(s)) for s in range(PIPELINED)), in_flight=DEPTH)
        with ring.acquire() as dropped:  # leaving the block unpublished gives the slot back
            dropped.write(b"never published")
        for seq in range(PIPELINED, PIPELINED + BY_HAND):
            data = batch(seq)
            slot = ring.acquire(timeout=20)
            slot.write(data)
            slot.publish(seq, len(data))
        ring.close()
    except BaseException as e:  # reported by the main thread
        errors.append(e)
        ring.close()


producer = threading.Thread(target=produce, daemon=True)
producer.start()
received, checked, taken = 0, 0, []
if device < 0:
    try:
        lib.stream(device).cuda_handle
        raise AssertionError("a host stream gave a CUDA handle")
    except cuferry.CuferryError as e:
        assert e.name == "CUFERRY_STATUS_UNSUPPORTED", e.name
try:
    for item in ring.items(stream, timeout=20):  # each item is released when the loop moves on
        assert item.sequence == received, f"FIFO order: got {item.sequence}, expected {received}"
        want = batch(received)
        assert item.nbytes == len(want), f"item {received}: {item.nbytes} bytes, expected {len(want)}"
        taken.append((received, want, take(item)))
        received += 1
except BaseException:
    ring.close()  # the producer stops with Closed instead of waiting forever
    raise
producer.join()
if errors:
    raise errors[0]
stream.synchronize()
for seq, want, got in taken:
    if got is None:
        continue
    got = got if isinstance(got, bytes) else got.get().tobytes()
    assert got == want, f"item {seq}: bytes differ"
    checked += 1
assert received == PIPELINED + BY_HAND, f"received {received} items"
stats = ring.stats()
assert stats["published"] == received and stats["occupancy"] == 0, stats
try:
    ring.next(stream, timeout=0)
    raise AssertionError("a closed, drained ring handed out an item")
except cuferry.Closed:
    pass
ring.free()

# produce with a timeout and no consumer: the ring takes DEPTH of the items and the call gives
# up, telling how many it published (a prefix); 0 gives up at once. Resumed from there once the
# consumer drained, every item arrives once, in order.
stalled = lib.ring(device, DEPTH, SLOT, fill_threads=2)
wanted = [(100 + s, batch(s)) for s in range(DEPTH + 2)]
for timeout, error in ((0.01, cuferry.Timeout), (0, cuferry.WouldBlock)):
    try:
        stalled.produce(wanted, in_flight=2, timeout=timeout)
        raise AssertionError("a full ring took every item")
    except error as e:
        assert e.published == (DEPTH if timeout else 0), (timeout, e.published)
assert stalled.stats()["published"] == DEPTH
for k in range(len(wanted)):
    if k == DEPTH:
        assert stalled.produce(wanted[DEPTH:], timeout=20) == 2
    item = stalled.next(stream, timeout=20)
    with item:
        assert item.sequence == wanted[k][0], (item.sequence, k)
        got = take(item)
        stream.synchronize()
        if got is not None:
            got = got if isinstance(got, bytes) else got.get().tobytes()
            assert got == wanted[k][1], f"stalled ring item {k}: bytes differ"
assert stalled.produce([]) == 0
# A sequence ctypes would wrap (negative, past 64 bits, a bool) is refused before anything is
# published, as `publish` refuses it; in_flight 0 counts as 1, as in the C ABI.
for sequence in (-1, 2**64 + 5, True):
    try:
        stalled.produce([(1, b"ok"), (sequence, b"abcd")])
        raise AssertionError(f"produce accepted sequence {sequence!r}")
    except ValueError:
        pass
assert stalled.stats()["published"] == len(wanted), "a refused produce published something"
assert stalled.produce([(200, b"one"), (201, b"two")], in_flight=0) == 2
for want in (200, 201):
    with stalled.next(stream, timeout=20) as item:
        assert item.sequence == want, (item.sequence, want)
stalled.free()

# A publish refused in Python (a negative length, a float sequence) keeps the slot with its
# guard: it can still be published, or abandoned, and the ring keeps its depth.
kept = lib.ring(device, 1, SLOT)
slot = kept.acquire(0)
for sequence, nbytes in ((1, -1), (1.5, 4), (1, 2**64)):
    try:
        slot.publish(sequence, nbytes)
        raise AssertionError(f"publish({sequence!r}, {nbytes!r}) was accepted")
    except ValueError:
        pass
slot.abandon()
slot = kept.acquire(0)  # the only slot came back
slot.write(b"kept")
slot.publish(7, 4)
with kept.next(stream, timeout=20) as item:
    assert item.sequence == 7 and item.nbytes == 4, (item.sequence, item.nbytes)
kept.free()

# Freeing a ring while a consumer waits in `next`: free closes it first, so the consumer
# returns Closed, and free waits for that call before destroying the ring.
waiting = lib.ring(device, DEPTH, SLOT)
outcome = []


def wait_for_an_item():
    try:
        waiting.next(stream)
        outcome.append("item")
    except cuferry.Closed:
        outcome.append("closed")
    except BaseException as e:
        outcome.append(e)


consumer = threading.Thread(target=wait_for_an_item, daemon=True)
consumer.start()
time.sleep(0.1)
waiting.free()
consumer.join(timeout=20)
assert outcome == ["closed"], outcome

# Two threads freeing a ring while a consumer waits in `next`: one destroys it, the other
# waits for that (both destroying it would free the C object twice).
for _ in range(20):
    waiting = lib.ring(device, DEPTH, SLOT)
    outcome = []
    consumer = threading.Thread(target=wait_for_an_item, daemon=True)
    consumer.start()
    time.sleep(0.005)
    freers = [threading.Thread(target=waiting.free, daemon=True) for _ in range(2)]
    for t in freers:
        t.start()
    for t in freers + [consumer]:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in freers + [consumer]), "a free or the consumer hung"
    assert outcome == ["closed"] and waiting.handle is None, outcome
# A call that starts after free() has waited for the calls in progress, just before it
# destroys the ring, must not reach the C ring (it would run on a freed object): it raises
# Closed. The library's `call` is wrapped to make that call at exactly that moment.
late = lib.ring(device, DEPTH, SLOT)
reached, late_outcome = [], []
real_call = lib.call


def late_stats():
    try:
        late.stats()
        late_outcome.append("returned")
    except cuferry.Closed:
        late_outcome.append("closed")


def call_between_wait_and_destroy(name, *args):
    if name == "cuferry_ring_destroy":
        caller = threading.Thread(target=late_stats)
        caller.start()
        caller.join(timeout=20)
    elif name == "cuferry_ring_stats":
        reached.append(name)
    return real_call(name, *args)


lib.call = call_between_wait_and_destroy
try:
    late.free()
finally:
    lib.call = real_call
assert late_outcome == ["closed"] and not reached, (late_outcome, reached)
assert late.handle is None

stream.free()
if checked < received:
    print(f"SKIP: bytes of {received - checked} items not checked (no CuPy to read device memory)")
print(f"python ring passed: {received} items in order, {checked} byte-checked")
