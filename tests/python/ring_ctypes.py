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
gives up with its published count, and resumes from it. Then Ring.produce streams: a generator
is pulled a batch at a time (bounded when a late consumer gets item 0, and in the items alive
at once), items of every buffer kind arrive intact, and a failure in a later batch (a timeout,
the generator's own error, an item refused) reports the items of the earlier batches plus the
ones its own published. Then a ring freed
while a consumer waits in `next`: the consumer gets Closed; and a call made between free()'s
wait and the destroy raises Closed without reaching the C ring. Exits non-zero on failure.
"""
import array
import ctypes
import os
import sys
import threading
import time
import weakref

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
# A sequence ctypes would wrap (negative, past 64 bits, a bool) is refused, as `publish`
# refuses it, before its batch (here the whole call) is published; in_flight 0 counts as 1, as
# in the C ABI.
for sequence in (-1, 2**64 + 5, True):
    try:
        stalled.produce([(1, b"ok"), (sequence, b"abcd")])
        raise AssertionError(f"produce accepted sequence {sequence!r}")
    except ValueError as e:
        assert e.published == 0, e.published
assert stalled.stats()["published"] == len(wanted), "a refused produce published something"
assert stalled.produce([(200, b"one"), (201, b"two")], in_flight=0) == 2
for want in (200, 201):
    with stalled.next(stream, timeout=20) as item:
        assert item.sequence == want, (item.sequence, want)
stalled.free()


def read_back(item):
    """The bytes of `item` (None on CUDA without CuPy), its stream synchronized."""
    got = take(item)
    stream.synchronize()
    return got if got is None or isinstance(got, bytes) else got.get().tobytes()


def drain(ring, first, count):
    """Takes `count` items, sequences from `first`, then finds the ring empty."""
    for k in range(count):
        with ring.next(stream, timeout=20) as item:
            assert item.sequence == first + k, (item.sequence, first + k)
    try:
        ring.next(stream, timeout=0)
        raise AssertionError("an item past the published ones")
    except cuferry.WouldBlock:
        pass


# Ring.produce streams: it pulls a batch of about the ring's size (here DEPTH items of SLOT
# bytes), publishes it, lets it go, and pulls the next. A consumer arriving late finds the
# generator advanced by at most two batches (one published, the next waiting for a slot),
# where reading everything first had pulled all of it; and at most a batch of its items is
# alive at any time.
LAZY = 8 * DEPTH
lazy = lib.ring(device, DEPTH, SLOT, fill_threads=2)
state = {"yielded": 0, "alive": 0, "most_alive": 0, "at_first": None, "received": 0}


class Chunk(bytearray):
    """A bytearray whose release can be watched (bytearray itself takes no weak reference)."""


def chunk_gone():
    state["alive"] -= 1


def chunks():
    for seq in range(LAZY):
        chunk = Chunk(SLOT)
        chunk[:8] = seq.to_bytes(8, "little")
        weakref.finalize(chunk, chunk_gone)
        state["alive"] += 1
        state["most_alive"] = max(state["most_alive"], state["alive"])
        state["yielded"] += 1
        yield seq, chunk
        del chunk


def late_consumer():
    try:
        time.sleep(0.3)  # the producer runs ahead as far as it can meanwhile
        for k in range(LAZY):
            with lazy.next(stream, timeout=20) as item:
                if k == 0:
                    state["at_first"] = state["yielded"]
                assert item.sequence == k and item.nbytes == SLOT, (item.sequence, item.nbytes, k)
                got = read_back(item)
                assert got is None or got[:8] == k.to_bytes(8, "little"), f"lazy item {k}: bytes differ"
                state["received"] += 1
    except BaseException as e:
        errors.append(e)
        lazy.close()


errors = []
consumer = threading.Thread(target=late_consumer, daemon=True)
consumer.start()
assert lazy.produce(chunks()) == LAZY
consumer.join(timeout=60)
if errors:
    raise errors[0]
assert state["received"] == LAZY, state
assert state["at_first"] is not None and state["at_first"] <= 2 * DEPTH, \
    f"the generator had yielded {state['at_first']} of {LAZY} items when item 0 was consumed"
assert state["most_alive"] <= DEPTH + 1, f"{state['most_alive']} items alive at once: not streamed"
assert state["alive"] == 0, "produce kept items alive after returning"
lazy.free()

# Items are read in place (bytes, bytearray, memoryviews read-only or not, array) or, not
# C-contiguous, copied; each arrives as its bytes. Data that is not bytes-like (an int, which
# bytes() took for a count of zeros) is refused.
kinds = lib.ring(device, 8, SLOT)
raw = bytes(range(256)) * 4
sources = [raw[:100], bytearray(raw[:200]), memoryview(raw)[7:300], memoryview(bytearray(raw))[3:50],
           array.array("H", range(40)), memoryview(bytearray(raw))[::3], b""]
assert kinds.produce(enumerate(sources), timeout=20) == len(sources)
for k, data in enumerate(sources):
    want = memoryview(data).tobytes()
    with kinds.next(stream, timeout=20) as item:
        assert item.sequence == k and item.nbytes == len(want), (k, item.sequence, item.nbytes)
        got = read_back(item) if want else b""
        assert got is None or got == want, f"source {k} ({type(data).__name__}): bytes differ"
same = b"unchanged bytes"
assert kinds.produce([(0, same), (1, same)]) == 2  # read-only memory twice is fine
drain(kinds, 0, 2)
try:
    kinds.produce([(0, b"ok"), (1, 5)])
    raise AssertionError("an int was taken for data")
except TypeError as e:
    assert "not bytes-like" in str(e) and e.published == 0, (e, e.published)




# A generator may refill one buffer for its next item, yielded as is or as a read-only view:
# memory that may change is never held across a pull (copied under 1 MiB; longer, published
# before the next pull), so every item arrives with its own bytes. Views of one buffer
# overlapping (sliding windows) are fine too.
def refilled(size, readonly):
    buf = bytearray(size)
    for seq in range(4):
        buf[:] = bytes([seq + 1]) * size
        yield seq, (memoryview(buf).toreadonly() if readonly else buf)


big = lib.ring(device, 4, 2 << 20)
for size in (16, 1 << 20, (1 << 20) + 5):
    for readonly in (False, True):
        assert big.produce(refilled(size, readonly), timeout=20) == 4
        for k in range(4):
            with big.next(stream, timeout=20) as item:
                assert item.sequence == k and item.nbytes == size, (item.sequence, item.nbytes)
                got = read_back(item)
                assert got is None or got == bytes([k + 1]) * size, \
                    f"refilled {size}-byte buffer (read-only view: {readonly}): item {k} holds other bytes"
window = memoryview(bytearray(raw))
assert big.produce(((k, window[10 * k:10 * k + 30]) for k in range(4)), timeout=20) == 4
for k in range(4):
    with big.next(stream, timeout=20) as item:
        got = read_back(item)
        assert got is None or got == raw[10 * k:10 * k + 30], f"sliding window {k}"
big.free()
assert kinds.stats()["published"] == len(sources) + 2, kinds.stats()
kinds.free()

# A failure in a later batch reports the items published by every batch before it, plus those
# its own batch published: always the first ones. (1) A consumer takes and releases 2 items,
# then stops: batch 1 fills the DEPTH slots, batch 2 gets the 2 released ones and times out
# on the third.
later = lib.ring(device, DEPTH, SLOT, fill_threads=2)
slot_items = [(k, bytes([k]) * SLOT) for k in range(3 * DEPTH)]


def take_two():
    try:
        for k in range(2):
            with later.next(stream, timeout=20) as item:
                assert item.sequence == k, (item.sequence, k)
    except BaseException as e:
        errors.append(e)


consumer = threading.Thread(target=take_two, daemon=True)
consumer.start()
try:
    later.produce(iter(slot_items), timeout=2)
    raise AssertionError("a stalled ring took every item")
except cuferry.Timeout as e:
    assert e.published == DEPTH + 2, e.published
consumer.join(timeout=20)
if errors:
    raise errors[0]
drain(later, 2, DEPTH)
later.free()
# (2) The iterator fails, or hands out an item that cannot be sent (a bad sequence, too large
# for a slot), while the second batch is gathered: the first batch is published, none of the
# second.


def failing_after(n, bad):
    yield from slot_items[:n]
    if bad is None:
        raise RuntimeError("the loader failed")
    yield bad


for bad, kind in ((None, RuntimeError), ((-1, b"x"), ValueError), ((99, bytes(SLOT + 1)), ValueError)):
    ring2 = lib.ring(device, DEPTH, SLOT)
    try:
        ring2.produce(failing_after(DEPTH + 1, bad))
        raise AssertionError(f"produce went past {bad!r}")
    except kind as e:
        assert e.published == DEPTH, (bad, e.published)
    drain(ring2, 0, DEPTH)
    ring2.free()

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
