"""Uses cuferry's C ABI from Python through python/cuferry.py (run by tests/python_ctypes.rs).

Usage: python3 ctypes_roundtrip.py LIBCUFERRY_SO DEVICE   (DEVICE -1: host backend)
Round-trips bytes pinned -> device -> pinned, checks that errors raise with the library's
message, and that the module's signatures (parsed from include/cuferry.h) cover every C
function. Exits non-zero on failure.
"""
import array
import ctypes
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import cuferry  # noqa: E402

lib = cuferry.load(sys.argv[1])
device = int(sys.argv[2])
print("cuferry", lib.version())
assert len(lib.functions) >= 40 and "cuferry_ring_next" in lib.functions, lib.functions
assert lib.const.CUFERRY_HOST == cuferry.HOST and lib.const.CUFERRY_STATUS_OK == 0
# The probe that picks a backend: 0 (not an error) without a driver or device.
count = lib.device_count()
assert count >= (0 if device == cuferry.HOST else device + 1), count

n = 1 << 20
payload = bytes((i * 13 + 5) % 251 for i in range(n))
with lib.stream(device) as stream, lib.pinned(device, n) as src, lib.device_buffer(stream, n) as dev, \
        lib.pinned(device, n) as back:
    assert src.size == n and back.read(16) == bytes(16), "pinned memory starts zeroed"
    src.write(payload)
    lib.copy(stream, src, dev, n)
    lib.copy(stream, dev, back, n)
    assert back.read() == payload, "round trip differs"
    # The second half moved to the front, through the offsets.
    lib.copy(stream, src, back, n // 2, src_offset=n // 2)
    assert back.read(n // 2) == payload[n // 2:], "offset copy differs"
    try:
        lib.copy(stream, src, back, 1, src_offset=n)
        raise AssertionError("a copy past the end was accepted")
    except cuferry.CuferryError as e:
        assert e.name == "CUFERRY_STATUS_INVALID_ARGUMENT", e
        assert e.message, "the library's message comes with the error"
    # A negative size or offset is refused before the call, not wrapped to a huge number.
    for call in (lambda: lib.pinned(device, -1), lambda: lib.copy(stream, src, back, 1, src_offset=-1)):
        try:
            call()
            raise AssertionError("a negative size or offset reached the library")
        except ValueError as e:
            assert "unsigned" in str(e), e
    if device == cuferry.HOST:
        assert dev.read(4) == payload[:4], "host-backend device memory is readable"
    else:
        try:
            dev.read(4)
            raise AssertionError("device memory read from the host")
        except ValueError:
            pass
    # A batch: sixteen 4 KiB pieces scattered in reverse order in one call, then read back.
    pieces = [(4096 * k + 1, 4096 * (15 - k), 4096) for k in range(16)]
    lib.copy_batch(stream, src, dev, pieces)
    lib.copy(stream, dev, back, 16 * 4096)
    got = back.read(16 * 4096)
    for k in range(16):
        piece = got[4096 * (15 - k):4096 * (16 - k)]
        assert piece == payload[4096 * k + 1:4096 * (k + 1) + 1], f"batch piece {k} differs"
    lib.copy_batch(stream, src, dev, [])
    # The same pieces from a buffer of native size_t triples (no Python loop over them), into
    # the other half of the buffer; a buffer of another format, or of a partial triple, raises.
    table = array.array("Q", (v for a, b, c in pieces for v in (a, b + n // 2, c)))
    if table.itemsize == ctypes.sizeof(ctypes.c_size_t):
        lib.copy_batch(stream, src, dev, table)
        lib.copy(stream, dev, back, 16 * 4096, src_offset=n // 2)
        assert back.read(16 * 4096) == got, "a batch from a buffer of ranges differs"
        pairs = memoryview(table[:6]).cast("B").cast("Q", [3, 2])  # 6 values, but pairs
        for bad in (array.array("b", [0, 0, 8]), table[:4], memoryview(table)[::2], pairs):
            try:
                lib.copy_batch(stream, src, dev, bad)
                raise AssertionError(f"the buffer of ranges {bad!r} was accepted")
            except ValueError:
                pass
        partial = array.array("Q", [0, 0, 8, 1])
        try:
            lib.copy_batch(stream, src, dev, partial)
            raise AssertionError("a partial triple was accepted")
        except ValueError as e:
            kept = e  # its traceback holds the refused call's frames
        partial.append(2)  # the buffer was released all the same: the array can resize
        del kept
    for bad, kind in (([(0, 0, 8), (100, 4, 8)], cuferry.CuferryError), ([(0, 0)], ValueError),
                      ([(0, -1, 8)], ValueError)):
        try:
            lib.copy_batch(stream, src, dev, bad)
            raise AssertionError(f"the batch {bad} was accepted")
        except kind as e:
            assert kind is ValueError or e.name == "CUFERRY_STATUS_INVALID_ARGUMENT", e
# Python objects' own memory, wrapped (no copy into pinned memory first): a replay store in
# bytes (read-only) gathered into device memory by one batch and copied out into a
# bytearray, which cannot resize while wrapped and can again once the wrapper is freed.
items, item = 64, 1000
store = bytes((i * 7 + 1) % 253 for i in range(items * item))
picked = [(k * 5) % items for k in range(16)]
out = bytearray(16 * item)
with lib.stream(device) as stream, lib.device_buffer(stream, 16 * item) as dev:
    source, target = lib.wrap(device, store), lib.wrap(device, out)
    assert source.read_only and not target.read_only and source.size == len(store), (source, target)
    try:
        out.append(0)
        raise AssertionError("a wrapped bytearray was resized")
    except BufferError:
        pass
    lib.copy_batch(stream, source, dev, [(i * item, k * item, item) for k, i in enumerate(picked)])
    lib.copy(stream, dev, target, 16 * item)
    for call, kind in ((lambda: lib.copy(stream, target, source, 1), cuferry.CuferryError),
                       (lambda: source.write(b"x"), ValueError),
                       (lambda: lib.wrap(device, store, read_only=False), BufferError)):
        try:
            call()
            raise AssertionError("read-only memory was written, or wrapped writable")
        except kind:
            pass
    source.free()
    target.free()  # waits for the copy into `out`
    out.append(0)
    assert bytes(out[:16 * item]) == b"".join(store[i * item:(i + 1) * item] for i in picked), "gather differs"
    # An object with `__cuda_array_interface__` (here the device buffer's own memory, host
    # memory on the host backend): wrapped as the device's memory, C-contiguous only.
    dev.synchronize()

    class Face:
        def __init__(self, ptr, nbytes, strides=None, stream=None):
            self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, True),
                                             "strides": strides, "version": 3, "stream": stream}

    if device == cuferry.HOST:
        try:
            lib.wrap(device, Face(dev.ptr, 16 * item))
            raise AssertionError("a CUDA array was wrapped for the host backend")
        except ValueError as e:
            assert "host backend" in str(e), e
    else:
        with lib.wrap(device, Face(dev.ptr, 16 * item)) as face, lib.pinned(device, 16 * item) as back:
            assert face.read_only and face.ptr == dev.ptr
            lib.copy(stream, face, back, 16 * item)
            assert back.read() == bytes(out[:16 * item]), "the wrapped device memory reads differently"
        # The producer's stream of a version-3 array is waited for: by a given stream, or by
        # the host (a cuferry stream stands in for the producer's); 0 is not a stream.
        with lib.stream(device) as producer:
            for given in (stream, None):
                lib.wrap(device, Face(dev.ptr, 8, stream=producer.cuda_handle), stream=given).free()
            lib.wrap(device, Face(dev.ptr, 8, stream=1)).free()
            with lib.stream(cuferry.HOST) as host_stream:
                try:
                    lib.wrap(device, Face(dev.ptr, 8, stream=1), stream=host_stream)
                    raise AssertionError("a host-backend stream waited for a CUDA array's producer")
                except ValueError as e:
                    assert "device" in str(e), e
            for bad in (0, -1, "s"):
                try:
                    lib.wrap(device, Face(dev.ptr, 8, stream=bad))
                    raise AssertionError(f"a CUDA array with stream {bad!r} was wrapped")
                except ValueError as e:
                    assert "stream" in str(e), e
    # One memory, one live wrapper: a second over any of its bytes raises, until the first
    # is freed.
    with lib.wrap(device, out) as first:
        try:
            lib.wrap(device, memoryview(out)[8:16])
            raise AssertionError("a second wrapper over live wrapped bytes was made")
        except cuferry.CuferryError as e:
            assert "live wrapper" in e.message, e
    lib.wrap(device, memoryview(out)[8:16]).free()
    for given, kind in ((5, TypeError), (stream, ValueError)):
        try:
            lib.wrap(device, bytearray(8), stream=given)
            raise AssertionError(f"stream={given!r} was taken for host memory")
        except kind:
            pass
    try:
        lib.wrap(0, Face(dev.ptr, 8, strides=(2,)))
        raise AssertionError("a strided CUDA array was wrapped")
    except ValueError as e:
        assert "contiguous" in str(e), e
# Memory that fits nowhere raises OutOfMemory, its own status (host memory on the host
# backend; cudaHostAlloc's cudaErrorMemoryAllocation on CUDA).
try:
    lib.pinned(device, 2**63 - 2**12)
    raise AssertionError("8 EiB of pinned memory were allocated")
except cuferry.OutOfMemory as e:
    assert e.name == "CUFERRY_STATUS_OUT_OF_MEMORY", e
    assert device != cuferry.HOST or str(2**63 - 2**12) in e.message, e
    # The status getter returns the status as its value (through `call` too, which raises
    # for a non-OK status of any other function).
    assert lib.call("cuferry_last_error_status") == lib.const.CUFERRY_STATUS_OUT_OF_MEMORY
# An empty buffer has no address: reading and writing nothing still work.
with lib.pinned(device, 0) as empty:
    assert empty.size == 0 and empty.read() == b"", "an empty buffer reads as nothing"
    empty.write(b"")
# Timeouts: a positive one waits at least a microsecond, a huge one does not wrap.
assert cuferry._micros(None) == -1 and cuferry._micros(0) == 0 and cuferry._micros(1e-9) == 1
assert cuferry._micros(1e300) == 2**63 - 1 and cuferry._micros(float("inf")) == 2**63 - 1
# The host wait mode exists for CUDA devices only.
if device == cuferry.HOST:
    for call in (lambda: lib.host_wait(device), lambda: lib.set_host_wait(device, "block")):
        try:
            call()
            raise AssertionError("a host wait mode on the host backend was accepted")
        except cuferry.CuferryError as e:
            assert e.name == "CUFERRY_STATUS_UNSUPPORTED", e
else:
    old = lib.host_wait(device)
    lib.set_host_wait(device, "block")
    assert lib.host_wait(device) == "block", "the host wait mode reads back"
    lib.set_host_wait(device, old)
try:
    lib.set_host_wait(device, "nap")
    raise AssertionError("an unknown host wait mode was accepted")
except ValueError:
    pass
# A handle of the wrong kind is refused in Python (every handle is a plain pointer to C, which
# would read a buffer as a stream), and a device number a C int cannot hold is not wrapped.
with lib.stream(device) as stream, lib.pinned(device, 16) as a, lib.pinned(device, 16) as b:
    for call in (lambda: lib.copy(a, b, stream, 4), lambda: lib.device_buffer(a, 16),
                 lambda: lib.copy(stream, stream, b, 4)):
        try:
            call()
            raise AssertionError("a handle of the wrong kind was accepted")
        except TypeError:
            pass
# Ordering with another library's stream: a host-backend stream has none to order with; a
# CUDA one waits for another stream given as a Stream, an int handle or an object with a
# `cuda_stream` (PyTorch) or `ptr` (CuPy); cuferry objects that are no stream are refused.
with lib.stream(device) as stream, lib.stream(device) as other, lib.pinned(device, 16) as a:
    if device == cuferry.HOST:
        for call in (lambda: stream.wait_cuda_stream(0), lambda: stream.make_cuda_stream_wait(0)):
            try:
                call()
                raise AssertionError("a host-backend stream was ordered with a CUDA stream")
            except cuferry.CuferryError as e:
                assert e.name == "CUFERRY_STATUS_UNSUPPORTED", e
    else:
        handle = other.cuda_handle
        torch_like = type("TorchLike", (), {"cuda_stream": handle, "device_index": device})()
        torch_default = type("TorchLike", (), {"cuda_stream": 0, "device_index": device})()
        cupy_like = type("Stream", (), {"ptr": handle, "device_id": device, "__module__": "cupy.cuda.stream"})()
        protocol = type("Protocol", (), {"__cuda_stream__": lambda self: (0, handle)})()
        for given in (other, handle, 0, 1, 2, torch_like, torch_default, cupy_like, protocol):
            stream.wait_cuda_stream(given)
            stream.make_cuda_stream_wait(given)
        stream.synchronize()
        other.synchronize()
    # Not streams: cuferry objects, negative or non-int handles, bools, another device's
    # stream, and objects that merely have a `ptr` (a CuPy MemoryPointer or Event has one).
    elsewhere = type("TorchLike", (), {"cuda_stream": 0, "device_index": device + 1})()
    pointer = type("MemoryPointer", (), {"ptr": 4096, "__module__": "cupy.cuda.memory"})()
    for bad, kind in ((a, TypeError), (-1, ValueError), ("s", ValueError), (True, ValueError),
                      (elsewhere, ValueError), (pointer, ValueError)):
        try:
            stream.wait_cuda_stream(bad)
            raise AssertionError(f"{bad!r} was taken for a stream")
        except kind:
            pass
for bad in (2**32 - 1, 2**31, -(2**31) - 1):
    try:
        lib.stream(bad)
        raise AssertionError(f"device {bad} was wrapped into range")
    except ValueError as e:
        assert "signed" in str(e), e
# A stream whose last wait fails (a CUDA stream with live managed allocations waits before it
# is destroyed) is destroyed all the same, and the wait's error is raised.
failing = lib.stream(device)
failing.device, failing._live_allocations = 0, 1
def wait_that_fails():  # noqa: E302
    raise RuntimeError("the stream's work failed")
failing.synchronize = wait_that_fails
try:
    failing.free()
    raise AssertionError("the failed wait was not raised")
except RuntimeError:
    assert failing.handle is None, "a stream whose last wait failed was leaked"
# A stream counts the managed allocations made on it and not freed (held strongly: weak
# references would be cleared before its finalizer runs when a cycle is collected).
with lib.stream(device) as counted:
    allocation = lib.managed_alloc(device, 4096, counted)
    assert counted._live_allocations == 1, counted._live_allocations
    allocation.free()
    allocation.free()
    assert counted._live_allocations == 0, counted._live_allocations
# Data that is not bytes-like, and offsets, sizes and addresses C would wrap, are refused.
with lib.pinned(device, 16) as p:
    for call in (lambda: p.write(5), lambda: p.write(True)):
        try:
            call()
            raise AssertionError("an int was written as zero bytes")
        except TypeError:
            pass
    for call in (lambda: p.read(True), lambda: p.read(4, -1), lambda: p.write(b"x", 2**64)):
        try:
            call()
            raise AssertionError("a bool, negative or huge offset or size was taken")
        except ValueError:
            pass
    for address in (p.ptr + 2**64, -1, True):
        try:
            lib.prefetch(address, 16, "host")
            raise AssertionError(f"address {address!r} was wrapped into range")
        except ValueError:
            pass
# A ring freed by another thread ends its consumers' loops and refuses producers (Closed), as
# a closed ring does; a free() interrupted while it waits for calls in progress leaves the
# ring live, and a later free() still frees it instead of waiting for the first for good.
import threading  # noqa: E402
with lib.stream(device) as consumer:
    ring = lib.ring(device, 2, 4096)
    ring.free()
    assert list(ring.items(consumer, timeout=1)) == [], "a freed ring handed out items"
    try:
        ring.acquire(timeout=0)
        raise AssertionError("a freed ring handed out a slot")
    except cuferry.Closed:
        pass

    class Interrupting(threading.Condition):
        """Raises KeyboardInterrupt from its second wait (free()'s wait for calls)."""
        waits = 0

        def wait_for(self, predicate, timeout=None):
            Interrupting.waits += 1
            if Interrupting.waits == 2:
                raise KeyboardInterrupt
            return super().wait_for(predicate, timeout)

    ring = lib.ring(device, 2, 4096)
    ring._idle = Interrupting()
    try:
        ring.free()
        raise AssertionError("the interrupt was not raised")
    except KeyboardInterrupt:
        pass
    assert ring.handle is not None and not ring._closing, "an interrupted free() left the ring stuck"
    again = threading.Thread(target=ring.free, daemon=True)
    again.start()
    again.join(timeout=20)
    assert not again.is_alive() and ring.handle is None, "a free() after an interrupted one hung"
# Errors survive pickling and copying (a worker process's error reaches its parent whole).
import copy  # noqa: E402
import pickle  # noqa: E402
try:
    lib.pinned(-5, 4)
    raise AssertionError("device -5 was accepted")
except cuferry.CuferryError as e:
    e.published = 3
    for again in (pickle.loads(pickle.dumps(e)), copy.copy(e)):
        assert type(again) is type(e) and str(again) == str(e), (again, e)
        assert (again.function, again.status, again.name, again.message, again.published) == \
            (e.function, e.status, e.name, e.message, 3), again
src.free()  # idempotent after the with block
try:
    src.size
    raise AssertionError("a freed buffer was used")
except ValueError:
    pass
print("python ctypes round trip passed")
