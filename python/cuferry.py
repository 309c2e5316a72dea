"""cuferry from Python: the C ABI (include/cuferry.h) through ctypes, with errors as exceptions.

Rules:
- The signatures come from the header itself, parsed when the library is loaded: every
  function of include/cuferry.h is callable on `Library.raw` with its argument and return
  types set, so this module never drifts from the ABI. Structs of the header become ctypes
  Structures (`Library.structs`), its #defines and status codes attributes of `Library.const`.
- A call returning a status other than OK raises `CuferryError` (or its subclass for
  WOULD_BLOCK, TIMEOUT, CLOSED and OUT_OF_MEMORY) with the library's message for the failing
  call.
- The classes own their handles: `free()` (or leaving a `with` block, or garbage collection)
  frees them once. Freeing waits for queued work as the C ABI does (a buffer's free waits
  for its copies), so dropping an object never frees memory under the device. Free a stream
  or buffer only when no other thread is using it; a ring's `free()` closes it and waits for
  the calls in progress on other threads (consumers blocked in `next` return `Closed`).
- Timeouts are in seconds (None waits for good, 0 never waits); the ABI's are microseconds.
- A value outside an integer C parameter's range (a negative or too large size, count or
  offset; a device number no C int holds; a bool) raises ValueError before the call through
  `Library.call` and the classes: ctypes would wrap it to another number (2**32 - 1 to -1,
  the host), and the library would answer about that one. A handle of the wrong class (a
  `Buffer` where a `Stream` goes) raises TypeError: to C every handle is a plain pointer.
- Errors pickle and copy with their status, name, message and `published`.
- Device -1 (`HOST`) is the host backend: everything runs without a GPU.
- `Ring.produce` streams: it pulls its items in batches of about the ring's size and never
  holds memory that may change across a pull (bytes are read in place; other buffers are
  copied under 1 MiB, or read in place and published before the next pull); every exception
  it raises carries `published`.
- Halo packers (`Library.halo_packer`) take `HaloExchange` descriptions and `Buffer`s the
  packer reaches, one per exchange (from `device_buffer`, or `wrap` of the device's own
  memory; any buffer on the host backend); a description is checked here (dims, negative values,
  ranges of step 1) and then by the library, whose message names the problem.
- Managed memory (`Library.managed_alloc`, `prefetch`, `prefetch_batch`, `advise`) names
  streams as None (the legacy default stream), a `Stream`, or a raw `cudaStream_t` int
  (`torch.cuda.current_stream().cuda_stream`); locations as "host" (or `HOST`), a device
  ordinal, ("numa", node) or "numa_current"; advice by the name of its `CUFERRY_ADVISE_*`
  constant in lower case ("set_read_mostly", ...). A `ManagedAllocation` is freed once, in
  order on its stream (the legacy default stream once that `Stream` is freed, which then
  waits for its work); the C free returns no status, so a failed free only sets the
  library's last error message. A device's pool is made on its first managed call with the
  defaults, or before that by `Library.managed_pool_configure` (`use_malloc_managed=True` for
  memory that takes advice where the driver refuses it on managed-pool memory).

Example (host backend; pass 0 for the first CUDA device):

    import cuferry
    lib = cuferry.load()                       # target/release/libcuferry.so of this checkout
    with lib.stream(cuferry.HOST) as s, lib.pinned(cuferry.HOST, 4) as src, \\
         lib.device_buffer(s, 4) as dev, lib.pinned(cuferry.HOST, 4) as back:
        src.write(b"abcd")
        lib.copy(s, src, dev, 4)
        lib.copy(s, dev, back, 4)
        assert back.read(4) == b"abcd"         # read waits for the copy
"""
import ctypes
import math
import os
import re
import sys
import threading
import warnings

__all__ = [
    "HOST", "CuferryError", "WouldBlock", "Timeout", "Closed", "OutOfMemory", "AllocationFailed",
    "ManagedOutOfMemory", "Library", "load", "HaloExchange", "HaloPacker", "ManagedAllocation",
    "WrappedBuffer",
]

HOST = -1
_HERE = os.path.dirname(os.path.abspath(__file__))


class CuferryError(Exception):
    """A cuferry call failed: `status` (the ABI's code), `name` (its name) and the message."""

    def __init__(self, function, status, name, message):
        super().__init__(f"{function}: {name} ({status}): {message}")
        self.function, self.status, self.name, self.message = function, status, name, message

    def __reduce__(self):
        # Rebuilt from the four values (Exception's default would pass only the text), with
        # any other attribute (`published`) restored: errors cross process boundaries
        # (multiprocessing, ProcessPoolExecutor) and `copy` intact.
        return (type(self), (self.function, self.status, self.name, self.message), self.__dict__)


class WouldBlock(CuferryError):
    """A call that does not wait found nothing to do (CUFERRY_STATUS_WOULD_BLOCK)."""


class Timeout(CuferryError):
    """A wait ran out of time (CUFERRY_STATUS_TIMEOUT)."""


class Closed(CuferryError):
    """The ring was closed (CUFERRY_STATUS_CLOSED); consumers see it once drained."""


class OutOfMemory(CuferryError):
    """An allocation did not fit (CUFERRY_STATUS_OUT_OF_MEMORY): device or pinned memory,
    host memory, or a managed pool's size limit. Where memory ran out, the library freed its
    own cached memory and tried again before raising (a pool at its limit fails at once);
    freeing the caller's memory is what may help."""


class AllocationFailed(CuferryError):
    """`cuferry_managed_malloc` returned NULL. That call returns no status (it keeps PyTorch's
    allocator signature): `status` and `name` are those `cuferry_last_error_status` gives for
    it, and the message says why."""


class ManagedOutOfMemory(AllocationFailed, OutOfMemory):
    """`cuferry_managed_malloc` returned NULL for lack of memory (or past its pool's size
    limit): caught by `except OutOfMemory` as well as by `except AllocationFailed`."""


# ---- the header ---------------------------------------------------------------------------

_SCALARS = {
    "int8_t": ctypes.c_int8, "uint8_t": ctypes.c_uint8, "int16_t": ctypes.c_int16,
    "uint16_t": ctypes.c_uint16, "int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32,
    "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t,
    "ssize_t": ctypes.c_ssize_t, "int": ctypes.c_int, "unsigned": ctypes.c_uint,
    "bool": ctypes.c_bool, "float": ctypes.c_float, "double": ctypes.c_double,
    "char": ctypes.c_char,
}
# The integer types of those: a Python int outside one's range is refused (module rules).
_UNSIGNED = (ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint)
_SIGNED = (ctypes.c_int8, ctypes.c_int16, ctypes.c_int32, ctypes.c_int64, ctypes.c_ssize_t, ctypes.c_int,
           ctypes.c_long)
_SIZE_BITS = 8 * ctypes.sizeof(ctypes.c_size_t)


def _handle(obj, cls, what):
    """`obj`'s live handle when it is a `cls`, else TypeError: every handle is a plain pointer
    to C, so a Buffer passed as a Stream would be read as one."""
    if not isinstance(obj, cls):
        raise TypeError(f"{what} must be a {cls.__name__}, not {type(obj).__name__}")
    return obj._live()


def _int(value, bits, what):
    """`value` if it is an int (not a bool) that a signed C parameter of `bits` holds, else
    ValueError: ctypes would wrap it to another number (2**32 - 1 to -1, the host)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is {value!r}, but the C parameter is an integer")
    if not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        raise ValueError(f"{what} is {value}, but the C parameter is a signed {bits}-bit integer")
    return value


def _bytes_like(data, what):
    """`data` as bytes: any bytes-like object, not an int (`bytes(5)` is five zero bytes)."""
    if isinstance(data, int):
        raise TypeError(f"{what}: {data!r} is an int, not bytes-like data")
    return bytes(data)


def _uint(value, bits, what):
    """`value` if it is an int (not a bool) in 0..2**bits, else ValueError: ctypes would wrap a
    negative or too large number to another one, and the library would answer about that."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is {value!r}, but the C parameter is an unsigned integer")
    if not 0 <= value < 2**bits:
        raise ValueError(f"{what} is {value}, but the C parameter is unsigned, below 2**{bits}")
    return value


# The buffer formats of a native size_t, for `copy_batch`'s tables: "N" is size_t itself; the
# fixed-size codes of its width (numpy's uint64 on a 64-bit platform is "Q" or "L", with a byte
# order prefix that must be the native one).
_SIZE_T_CODES = {"N"} | {
    code
    for code, ctype in (("I", ctypes.c_uint), ("L", ctypes.c_ulong), ("Q", ctypes.c_ulonglong))
    if ctypes.sizeof(ctype) == ctypes.sizeof(ctypes.c_size_t)
}
_NATIVE_ORDER = ("", "@", "=", "<" if sys.byteorder == "little" else ">")


def _range_table(cls, ranges):
    """The C table of `copy_batch`'s ranges and its length: copied at C speed from a buffer of
    native size_t triples (flat, or of shape (n, 3)), or built from a sequence of triples with
    every value checked."""
    try:
        view = memoryview(ranges)
    except (TypeError, ValueError):  # no buffer (a list), or one memoryview cannot describe
        view = None
    if view is None:
        ranges = list(ranges)
        table = (cls * len(ranges))()
        for k, r in enumerate(ranges):
            if len(r) != 3:
                raise ValueError(f"copy_batch: range {k} is {r!r}, not (src_offset, dst_offset, nbytes)")
            for value, what in zip(r, ("src_offset", "dst_offset", "nbytes")):
                _uint(value, _SIZE_BITS, f"copy_batch: range {k}'s {what}")
            table[k] = cls(*r)
        return table, len(ranges)
    # Released on every path: a view kept alive by an exception's traceback would keep the
    # caller's array from resizing.
    with view:
        code = view.format.lstrip("@=<>!")
        order = view.format[: len(view.format) - len(code)]
        if code not in _SIZE_T_CODES or order not in _NATIVE_ORDER or view.itemsize != ctypes.sizeof(ctypes.c_size_t):
            raise ValueError(f"copy_batch: a buffer of ranges must hold native size_t values, not format {view.format!r}")
        if not view.c_contiguous:
            raise ValueError("copy_batch: a buffer of ranges must be C-contiguous")
        flat = view.ndim == 1 and view.shape[0] % 3 == 0
        if not (flat or (view.ndim == 2 and view.shape[1] == 3)):
            raise ValueError(f"copy_batch: a buffer of ranges has shape {view.shape}, not (n, 3) or (3 n,)")
        count = view.nbytes // ctypes.sizeof(cls)
        return (cls * count).from_buffer_copy(view), count


class _Header:
    """The declarations of cuferry.h: #defines, the status enum, structs, opaque types and
    function prototypes (cbindgen's regular output; anything else is an error here)."""

    def __init__(self, text):
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        text = re.sub(r"//[^\n]*", "", text)
        self.defines = {m[0]: int(m[1]) for m in re.findall(r"#define\s+(\w+)\s+(-?\d+)\s*$", text, re.M)}
        body = re.search(r"typedef enum CuferryStatus \{(.*?)\}", text, re.S)
        if body is None:
            raise ValueError("cuferry.h: no CuferryStatus enum")
        self.statuses = {m[0]: int(m[1]) for m in re.findall(r"(\w+)\s*=\s*(-?\d+)", body.group(1))}
        self.opaque = set(re.findall(r"typedef struct (\w+) \1;", text))
        self.struct_fields = {}
        for name, fields in re.findall(r"typedef struct (\w+) \{(.*?)\} \1;", text, re.S):
            self.struct_fields[name] = [
                (f[0].strip(), f[1], f[2]) for f in re.findall(r"([\w\s]+?)\s*(\w+)(?:\[(\w+)\])?;", fields)
            ]
        self.functions = {}
        start = text.find('extern "C" {')
        if start < 0:
            raise ValueError('cuferry.h: no extern "C" block')
        prototypes = re.sub(r"^\s*#.*$", "", text[start + len('extern "C" {'):], flags=re.M)
        for ret, name, args in re.findall(r"([\w\s\*]+?)\s*\b(cuferry_\w+)\(([^)]*)\);", prototypes, re.S):
            args = " ".join(args.split())
            params = [] if args in ("", "void") else [a.strip() for a in args.split(",")]
            self.functions[name] = (" ".join(ret.split()), [self._strip_name(p) for p in params])

    @staticmethod
    def _strip_name(param):
        """`const struct CuferryStream *stream` -> `const struct CuferryStream *`."""
        m = re.match(r"(.*?[\s\*])(\w+)$", param)
        if m is None:
            raise ValueError(f"cuferry.h: cannot read parameter {param!r}")
        return m.group(1).strip()


def _ctype(decl, structs, opaque):
    """The ctypes type of a C type as cbindgen writes it (None for void)."""
    decl = re.sub(r"\bconst\b", "", decl)
    depth = decl.count("*")
    base = " ".join(decl.replace("*", " ").split())
    base = base.removeprefix("struct ").removeprefix("enum ")
    if base == "CuferryStatus":
        scalar = ctypes.c_int32
    elif base in opaque or base == "void":
        if depth == 0:
            return None
        scalar, depth = ctypes.c_void_p, depth - 1
    elif base in structs:
        scalar = structs[base]
    elif base in _SCALARS:
        scalar = _SCALARS[base]
        if base == "char" and depth == 1:
            return ctypes.c_char_p
    else:
        raise ValueError(f"cuferry.h: unknown type {decl!r}")
    for _ in range(depth):
        scalar = ctypes.POINTER(scalar)
    return scalar


class _Namespace:
    def __init__(self, values):
        self.__dict__.update(values)


# ---- the library --------------------------------------------------------------------------


class Library:
    """libcuferry loaded with the signatures of its header. `raw` has every C function (their
    names: `functions`); the methods below wrap the common ones."""

    def __init__(self, library_path, header_path):
        with open(header_path, encoding="utf-8") as f:
            header = _Header(f.read())
        self.raw = ctypes.CDLL(library_path)
        self.const = _Namespace({**header.defines, **header.statuses})
        self.structs = {}
        for name, fields in header.struct_fields.items():
            cfields = []
            for ctype, field, dim in fields:
                t = _ctype(ctype, self.structs, header.opaque)
                if dim:
                    t = t * (header.defines[dim] if dim in header.defines else int(dim))
                cfields.append((field, t))
            self.structs[name] = type(name, (ctypes.Structure,), {"_fields_": cfields})
        self._status_names = {v: k for k, v in header.statuses.items()}
        self._raised = {
            header.statuses["CUFERRY_STATUS_WOULD_BLOCK"]: WouldBlock,
            header.statuses["CUFERRY_STATUS_TIMEOUT"]: Timeout,
            header.statuses["CUFERRY_STATUS_CLOSED"]: Closed,
            header.statuses["CUFERRY_STATUS_OUT_OF_MEMORY"]: OutOfMemory,
        }
        self._checked = set()
        self._integers = {}
        self.functions = sorted(header.functions)
        for name, (ret, params) in header.functions.items():
            fn = getattr(self.raw, name)
            fn.argtypes = [_ctype(p, self.structs, header.opaque) for p in params]
            fn.restype = _ctype(ret, self.structs, header.opaque)
            self._integers[name] = [
                (i, 8 * ctypes.sizeof(t), t in _UNSIGNED)
                for i, t in enumerate(fn.argtypes)
                if t in _UNSIGNED or t in _SIGNED
            ]
            # A status getter returns a status as its value, not as its own failure.
            if ret == "enum CuferryStatus" and name != "cuferry_last_error_status":
                self._checked.add(name)

    def call(self, name, *args):
        """Calls C function `name`; a status other than OK raises (see the module rules)."""
        self.check_arguments(name, args)
        return self._check(name, getattr(self.raw, name)(*args))

    def check_arguments(self, name, args):
        """Raises ValueError for an int argument of `name` that its C parameter cannot hold
        (what `call` checks before reaching C)."""
        for i, bits, unsigned in self._integers[name]:
            if i < len(args) and isinstance(args[i], int):
                (_uint if unsigned else _int)(args[i], bits, f"{name}: argument {i + 1}")

    def _check(self, name, result):
        """Raises for a status of `name` other than OK; returns `result` otherwise."""
        if name in self._checked and result != self.const.CUFERRY_STATUS_OK:
            message = (self.raw.cuferry_last_error_message() or b"").decode(errors="replace")
            kind = self._raised.get(result, CuferryError)
            raise kind(name, result, self._status_names.get(result, "unknown status"), message)
        return result

    def version(self):
        """The library's version string."""
        return self.raw.cuferry_version().decode()

    def device_count(self):
        """CUDA devices usable by this process (0 without a driver or device, or in a build
        without CUDA; other failures raise)."""
        n = ctypes.c_int32()
        result = self.raw.cuferry_device_count(ctypes.byref(n))
        c = self.const
        if result in (c.CUFERRY_STATUS_NO_DRIVER, c.CUFERRY_STATUS_NO_DEVICE, c.CUFERRY_STATUS_UNSUPPORTED):
            return 0
        self._check("cuferry_device_count", result)
        return n.value

    def host_wait(self, device):
        """How host threads wait for CUDA device `device`: one of "auto", "spin", "yield",
        "block" (CUDA's device scheduling flag). Raises UNSUPPORTED for HOST."""
        mode = ctypes.c_int32()
        self.call("cuferry_device_host_wait", device, ctypes.byref(mode))
        return {v: k for k, v in self._host_waits().items()}[mode.value]

    def set_host_wait(self, device, mode):
        """Sets how host threads wait for CUDA device `device` from now on: "block" leaves the
        cores of waiting threads to other work, "spin" answers soonest. Process-wide for the
        device (PyTorch and CuPy included); leaves the device current on this thread."""
        modes = self._host_waits()
        if mode not in modes:
            raise ValueError(f"host wait {mode!r}: use one of {sorted(modes)}")
        self.call("cuferry_device_set_host_wait", device, modes[mode])

    def _host_waits(self):
        c = self.const
        return {"auto": c.CUFERRY_HOST_WAIT_AUTO, "spin": c.CUFERRY_HOST_WAIT_SPIN,
                "yield": c.CUFERRY_HOST_WAIT_YIELD, "block": c.CUFERRY_HOST_WAIT_BLOCK}

    def stream(self, device):
        """A new stream on `device` (HOST for the host backend)."""
        return Stream(self, device)

    def pinned(self, device, nbytes):
        """`nbytes` of pinned host memory for copies to and from `device`, zeroed."""
        out = ctypes.c_void_p()
        self.call("cuferry_pinned_alloc", device, nbytes, ctypes.byref(out))
        return Buffer(self, out, host_readable=True)

    def device_buffer(self, stream, nbytes):
        """`nbytes` of memory on `stream`'s device, zeroed in order on `stream`."""
        out = ctypes.c_void_p()
        self.call("cuferry_device_alloc", _handle(stream, Stream, "stream"), nbytes, ctypes.byref(out))
        return Buffer(self, out, host_readable=stream.device == HOST)

    def copy(self, stream, src, dst, nbytes, src_offset=0, dst_offset=0):
        """Queues a copy of `nbytes` on `stream`, ordered after both buffers' earlier uses."""
        self.call(
            "cuferry_copy",
            _handle(stream, Stream, "stream"),
            _handle(src, Buffer, "src"),
            src_offset,
            _handle(dst, Buffer, "dst"),
            dst_offset,
            nbytes,
        )

    def copy_batch(self, stream, src, dst, ranges):
        """Queues `ranges` from `src` to `dst` on `stream` as one batch (one
        cudaMemcpyBatchAsync on CUDA): the copies run in no set order, so no byte may be
        written twice, or written by one and read by another. `ranges` holds (src_offset,
        dst_offset, nbytes) triples: a sequence of them, or, read without a Python loop, a
        C-contiguous buffer of native size_t values, three per range (`array.array("Q")`, or a
        numpy array of shape (n, 3) and dtype uint64, on a 64-bit platform)."""
        table, count = _range_table(self.structs["CuferryCopyRange"], ranges)
        self.call(
            "cuferry_copy_batch",
            _handle(stream, Stream, "stream"),
            _handle(src, Buffer, "src"),
            _handle(dst, Buffer, "dst"),
            table,
            count,
        )

    def wrap(self, device, obj, read_only=None, stream=None):
        """`obj`'s own memory as a `Buffer` for copies with `device`, without copying it:
        host memory through the buffer protocol (bytes, bytearray, array.array, a C-contiguous
        numpy array), or device memory through `__cuda_array_interface__` (a CuPy array, a
        PyTorch CUDA tensor), C-contiguous. The buffer holds `obj` (a host object cannot be
        resized meanwhile) until `free()`, which waits for the copies queued on it.
        `read_only` (default: what `obj` says) makes copies into it an error. Pageable host
        memory is page-locked while wrapped when the driver allows. One memory has one live
        wrapper at a time (a second over any of its bytes raises): use it for every copy, a
        writable wrapper is a source too. CUDA arrays are refused for the host backend (HOST).

        A CUDA array's `__cuda_array_interface__["stream"]` (version 3: the stream its
        producer queued work on) is waited for as the interface asks: by `stream` (a cuferry
        `Stream` of `device`, whose later work then waits for it without blocking: copy on
        that stream), or without one by the host, before `wrap` returns (`stream` is for CUDA
        arrays only). Other work on the memory that cuferry did not queue is the caller's to
        order (`Stream.wait_cuda_stream` and `Stream.make_cuda_stream_wait`, or let it finish
        first)."""
        return WrappedBuffer(self, device, obj, read_only, stream)

    def ring(self, device, depth, slot_bytes, fill_threads=4):
        """A slot ring of `depth` slots of `slot_bytes` uploading to `device`; `fill_threads`
        (at least 1) threads fill slots from pageable memory in `Ring.produce`."""
        return Ring(self, device, depth, slot_bytes, fill_threads)

    # ---- halo packers ----

    def halo_packer(self, device, exchanges):
        """A packer on `device` for `exchanges` (`HaloExchange`s, in the order the arrays are
        passed to `HaloPacker.pack` and `unpack`)."""
        return HaloPacker(self, device, exchanges)

    # ---- managed memory ----

    def managed_alloc(self, device, nbytes, stream=None):
        """`nbytes` (> 0) of managed memory from `device`'s pool (HOST: the host backend's
        pool of plain host memory), in order on `stream` (see the module rules)."""
        _uint(nbytes, _SIZE_BITS - 1, "managed_alloc: nbytes")  # an ssize_t
        if nbytes == 0:
            raise ValueError("managed_alloc: 0 bytes; allocate at least one")
        # Called raw (it returns a pointer, not a status), so checked here as `call` would.
        self.check_arguments("cuferry_managed_malloc", (nbytes, device))
        ptr = self.raw.cuferry_managed_malloc(nbytes, device, _raw_stream(stream, device))
        if not ptr:
            message = (self.raw.cuferry_last_error_message() or b"").decode(errors="replace")
            status = self.raw.cuferry_last_error_status()
            oom = status == self.const.CUFERRY_STATUS_OUT_OF_MEMORY
            raise (ManagedOutOfMemory if oom else AllocationFailed)(
                "cuferry_managed_malloc", status, self._status_names.get(status, "unknown status"), message)
        allocation = ManagedAllocation(self, ptr, nbytes, device, stream)
        if isinstance(stream, Stream):
            stream._live_allocations += 1
        return allocation

    def location(self, where):
        """`where` ("host" or `HOST`, a device ordinal, ("numa", node) or "numa_current") as a
        `CuferryLocation`."""
        c, loc = self.const, self.structs["CuferryLocation"]
        if where == "host" or (isinstance(where, int) and not isinstance(where, bool) and where == HOST):
            return loc(c.CUFERRY_LOCATION_HOST, 0)
        if where == "numa_current":
            return loc(c.CUFERRY_LOCATION_HOST_NUMA_CURRENT, 0)
        if isinstance(where, int) and not isinstance(where, bool) and 0 <= where < 2**31:
            return loc(c.CUFERRY_LOCATION_DEVICE, where)
        if (isinstance(where, tuple) and len(where) == 2 and where[0] == "numa"
                and isinstance(where[1], int) and not isinstance(where[1], bool) and 0 <= where[1] < 2**31):
            return loc(c.CUFERRY_LOCATION_HOST_NUMA, where[1])
        raise ValueError(
            f"location {where!r}: use \"host\" (or HOST), a device ordinal, (\"numa\", node) or \"numa_current\"")

    def prefetch(self, ptr, nbytes, where, stream=None):
        """Queues moving `nbytes` of managed memory at `ptr` (an address or a
        `ManagedAllocation`) to `where`, on `stream`."""
        self.call("cuferry_managed_prefetch", _address(ptr), nbytes, self.location(where),
                  _raw_stream(stream, _device_of(ptr)))

    def prefetch_batch(self, ranges, where, stream=None):
        """Queues moving every (address or `ManagedAllocation`, nbytes) range to `where` in one
        batched call on `stream` (one call per range where CUDA allows no batch)."""
        ranges = list(ranges)
        n = len(ranges)
        for _, nbytes in ranges:
            _uint(nbytes, _SIZE_BITS, "prefetch_batch: a range's size")
        location = self.location(where)
        devices = {_device_of(p) for p, _ in ranges} - {None}
        raw = _raw_stream(stream, devices.pop() if len(devices) == 1 else None)
        ptrs = (ctypes.c_void_p * n)(*(_address(p) for p, _ in ranges))
        sizes = (ctypes.c_size_t * n)(*(nbytes for _, nbytes in ranges))
        self.call("cuferry_managed_prefetch_batch", ptrs, sizes, n, location, raw)

    def advise(self, ptr, nbytes, advice, where=None):
        """Gives `advice` ("set_read_mostly", "set_preferred_location", "set_accessed_by", and
        their "unset_" forms) for `nbytes` of managed memory at `ptr`; `where` for the advice
        that names a location."""
        names = {k.removeprefix("CUFERRY_ADVISE_").lower(): v for k, v in vars(self.const).items()
                 if k.startswith("CUFERRY_ADVISE_")}
        if advice not in names:
            raise ValueError(f"advice {advice!r}: use one of {sorted(names)}")
        located = advice in ("set_preferred_location", "set_accessed_by", "unset_accessed_by")
        if located and where is None:
            raise ValueError(f"advice {advice!r} names a location: pass where=")
        if not located and where is not None:
            raise ValueError(f"advice {advice!r} names no location, but where={where!r} was given")
        location = self.location(where) if located else self.structs["CuferryLocation"](0, 0)
        self.call("cuferry_managed_advise", _address(ptr), nbytes, names[advice], location)

    def pool_stats(self, device):
        """Byte counters of `device`'s managed pool as a dict (reserved_current, reserved_high,
        used_current, used_high)."""
        out = self.structs["CuferryPoolStats"]()
        self.call("cuferry_managed_pool_stats", device, ctypes.byref(out))
        return {name: getattr(out, name) for name, _ in out._fields_}

    def pool_kind(self, device):
        """What backs `device`'s managed pool: "host", "managed_pool" or "malloc_managed"."""
        kind = ctypes.c_int32()
        self.call("cuferry_managed_pool_kind", device, ctypes.byref(kind))
        return {0: "host", 1: "managed_pool", 2: "malloc_managed"}[kind.value]

    def managed_pool_configure(self, device, use_malloc_managed=False, max_size=0, prefer_device=True):
        """Makes `device`'s managed pool (`cuferry_managed_pool_configure`) before its first
        use: `use_malloc_managed` for `cudaMallocManaged` allocations, which take `advise`
        where the driver refuses advice on managed-pool memory (the H100's driver 580.159
        does; not stream-ordered); `max_size` the most bytes it may hold (0: no limit);
        `prefer_device` False for a managed pool with no preferred location. Without it the
        device's first managed call (`managed_alloc`, `pool_stats`, `pool_kind`, ...) makes the
        pool with the defaults. The same options again succeed; other options once the pool
        exists raise `CuferryError` (INVALID_ARGUMENT) naming the existing pool. On HOST only
        `max_size` counts (the other two are accepted and ignored)."""
        for what, value in (("use_malloc_managed", use_malloc_managed), ("prefer_device", prefer_device)):
            if not isinstance(value, bool):
                raise ValueError(f"managed_pool_configure: {what} is {value!r}, not a bool")
        c = self.const
        flags = (c.CUFERRY_MANAGED_POOL_MALLOC_MANAGED if use_malloc_managed else 0) | (
            0 if prefer_device else c.CUFERRY_MANAGED_POOL_NO_PREFERRED_LOCATION)
        self.call("cuferry_managed_pool_configure", device, flags, max_size)


def load(library_path=None, header_path=None):
    """Loads libcuferry. Defaults: $CUFERRY_LIB, else target/release/libcuferry.so of the
    checkout holding this file; $CUFERRY_HEADER, else its include/cuferry.h."""
    root = os.path.dirname(_HERE)
    library_path = library_path or os.environ.get("CUFERRY_LIB") or os.path.join(
        root, "target", "release", "libcuferry.so")
    header_path = header_path or os.environ.get("CUFERRY_HEADER") or os.path.join(root, "include", "cuferry.h")
    return Library(library_path, header_path)


_MAX_MICROS = 2**63 - 1


def _micros(timeout):
    """Seconds (None: for good) as the ABI's microseconds (negative: for good). A positive
    timeout waits at least a microsecond; one beyond an int64 of microseconds waits that long
    (about 292,000 years) rather than wrapping."""
    if timeout is None:
        return -1
    return max(0, math.ceil(min(timeout * 1e6, _MAX_MICROS)))


class _Owned:
    """Released once by `_finish`, at the end of a `with` block or by garbage collection."""

    def _finish(self):
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._finish()

    def __del__(self):
        try:
            self._finish()
        except Exception:  # interpreter shutdown, or a failure nobody can act on
            pass


class _Handle(_Owned):
    """An owned handle freed once by C function `_free` (`free()`, `with`, or garbage
    collection)."""

    _free = None

    def __init__(self, lib, handle):
        self.lib, self.handle = lib, handle

    def free(self):
        """Frees the handle (waiting for its queued work, as the C ABI does); idempotent."""
        handle, self.handle = self.handle, None
        if handle is not None and handle.value is not None:
            self.lib.call(self._free, handle)

    def _finish(self):
        self.free()

    def _live(self):
        if self.handle is None:
            raise ValueError(f"{type(self).__name__} used after free()")
        return self.handle


class Stream(_Handle):
    """A cuferry stream (`cuferry_stream_create`)."""

    _free = "cuferry_stream_destroy"

    def __init__(self, lib, device):
        out = ctypes.c_void_p()
        lib.call("cuferry_stream_create", device, ctypes.byref(out))
        super().__init__(lib, out)
        self.device = device
        # Managed allocations made on this stream and not freed yet (see `free`): a count,
        # not weak references, which garbage collection of a cycle clears before it runs the
        # stream's finalizer.
        self._live_allocations = 0

    def free(self):
        """Destroys the stream (work already queued still runs); idempotent. While managed
        allocations made on it are live, it first waits for its work, so that they can be
        freed later on the legacy default stream in order. If that wait fails, the stream is
        destroyed all the same and the wait's error is raised."""
        try:
            if self.handle is not None and self.device != HOST and self._live_allocations > 0:
                self.synchronize()
        finally:
            super().free()

    def synchronize(self):
        """Waits for everything queued on the stream."""
        self.lib.call("cuferry_stream_synchronize", self._live())

    @property
    def cuda_handle(self):
        """The stream's `cudaStream_t` as an int, for queuing CUDA work on it
        (`cupy.cuda.ExternalStream`, `torch.cuda.ExternalStream`); owned by this stream.
        Raises `CuferryError` (UNSUPPORTED) for a host-backend stream."""
        out = ctypes.c_void_p()
        self.lib.call("cuferry_stream_cuda_handle", self._live(), ctypes.byref(out))
        return out.value

    def wait_cuda_stream(self, other):
        """Orders the work queued on this stream from now on after everything queued so far
        on `other`, a CUDA stream of this stream's device: a `torch.cuda.Stream`
        (`torch.cuda.current_stream()`), a CuPy stream, another cuferry `Stream`, or a
        `cudaStream_t` int (0: the legacy default stream). Call it before copying from a
        tensor whose producing kernels may still run. Neither stream blocks the host. Raises
        `CuferryError` (UNSUPPORTED) for a host-backend stream."""
        self.lib.call("cuferry_stream_wait_cuda_stream", self._live(), _foreign_stream(other, self.device))

    def make_cuda_stream_wait(self, other):
        """Orders the work queued on `other` (as for `wait_cuda_stream`) from now on after
        everything queued so far on this stream: call it before that library's kernels read
        a tensor cuferry copies or unpacks into, instead of `synchronize`."""
        self.lib.call("cuferry_cuda_stream_wait_stream", _foreign_stream(other, self.device), self._live())


class Buffer(_Handle):
    """Pinned host or device memory (`cuferry_pinned_alloc`, `cuferry_device_alloc`), or an
    object's own memory (`WrappedBuffer`, from `Library.wrap`)."""

    _free = "cuferry_buffer_free"

    def __init__(self, lib, handle, host_readable):
        super().__init__(lib, handle)
        self.host_readable = host_readable

    @property
    def ptr(self):
        """The memory's address (a device address for device memory)."""
        return self.lib.raw.cuferry_buffer_ptr(self._live())

    @property
    def size(self):
        """Bytes allocated."""
        return self.lib.raw.cuferry_buffer_size(self._live())

    def synchronize(self):
        """Waits for every queued use of the buffer."""
        self.lib.call("cuferry_buffer_synchronize", self._live())

    def _host_range(self, offset, nbytes):
        _uint(offset, 63, "offset")
        _uint(nbytes, 63, "nbytes")
        if not self.host_readable:
            raise ValueError("device memory: copy it to a pinned buffer to read or write it")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"bytes {offset}..{offset + nbytes} of a {self.size}-byte buffer")
        self.synchronize()
        # An empty buffer has no address (NULL, which ctypes gives as None).
        return None if nbytes == 0 else self.ptr + offset

    def write(self, data, offset=0):
        """Copies `data` (bytes-like) in at `offset`, after the buffer's queued uses."""
        data = _bytes_like(data, "Buffer.write")
        address = self._host_range(offset, len(data))
        if address is not None:
            ctypes.memmove(address, data, len(data))

    def read(self, nbytes=None, offset=0):
        """`nbytes` (default: to the end) from `offset`, after the buffer's queued uses."""
        nbytes = self.size - offset if nbytes is None else nbytes
        address = self._host_range(offset, nbytes)
        return b"" if address is None else ctypes.string_at(address, nbytes)


# Wrapped memory whose wrapper could not be freed (a queued copy may still use it): held for
# good, so that Python never frees or resizes it.
_KEPT_FOREVER = []


def _cuda_array(obj):
    """(address, nbytes, read_only, stream) of a C-contiguous `__cuda_array_interface__`
    object (`stream`: the producer's `cudaStream_t` to wait for, or None)."""
    face = obj.__cuda_array_interface__
    shape, (address, read_only) = tuple(face["shape"]), face["data"]
    itemsize = int(face["typestr"][2:])
    nbytes = math.prod(shape) * itemsize
    strides, expected = face.get("strides"), []
    if strides is not None:
        step = itemsize
        for extent in reversed(shape):
            expected.insert(0, step)
            step *= extent
        if nbytes and any(s != e for s, e, n in zip(strides, expected, shape) if n > 1):
            raise ValueError(f"wrap: a CUDA array of strides {tuple(strides)} is not C-contiguous")
    if face.get("mask") is not None:
        raise ValueError("wrap: a masked CUDA array")
    stream = face.get("stream")
    if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool) or stream <= 0):
        # The interface forbids 0 (ambiguous between the two default streams).
        raise ValueError(f"wrap: the CUDA array's stream {stream!r} is not a cudaStream_t (0 is not allowed)")
    return address or None, nbytes, bool(read_only), stream


class WrappedBuffer(Buffer):
    """Memory an object owns, wrapped by `Library.wrap` (`cuferry_buffer_wrap`): a `Buffer`
    for copies that holds its object until `free()`."""

    def __init__(self, lib, device, obj, read_only, stream=None):
        # Set first: a refused wrap leaves an object whose collection frees nothing.
        self.lib, self.handle, self._owner, self._view = lib, None, obj, None
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"wrap: stream {stream!r} is not a cuferry Stream")
        if stream is not None and stream.device != device:
            raise ValueError(f"wrap: {stream!r} is a stream of device {stream.device}, not {device}")
        cuda_array = hasattr(obj, "__cuda_array_interface__")
        if stream is not None and not cuda_array:
            raise ValueError("wrap: `stream` waits for a CUDA array's producer; this object is host memory")
        if cuda_array:
            if device == HOST:
                raise ValueError("wrap: a CUDA array's memory is not the host backend's (HOST)")
            address, nbytes, exported_read_only, producer = _cuda_array(obj)
            if producer is not None:
                if stream is not None:
                    stream.wait_cuda_stream(producer)
                else:
                    with lib.stream(device) as waiting:
                        waiting.wait_cuda_stream(producer)
                        waiting.synchronize()
            host_readable = False
        else:
            if _BUFFER_API is None:
                raise RuntimeError("wrap: this Python has no buffer API to hold host memory with")
            view = _PyBuffer()
            writable = read_only is False
            _BUFFER_API[0](obj, ctypes.byref(view), _PYBUF_SIMPLE | (1 if writable else 0))
            self._view = view
            address, nbytes, exported_read_only = view.buf, view.len, bool(view.readonly)
            host_readable = True
        self.read_only = exported_read_only if read_only is None else bool(read_only)
        if exported_read_only and not self.read_only:
            self._let_go()
            raise ValueError("wrap: the memory is read-only, so it can only be wrapped read_only")
        flags = lib.const.CUFERRY_WRAP_READ_ONLY if self.read_only else 0
        out = ctypes.c_void_p()
        try:
            lib.call("cuferry_buffer_wrap", device, address, nbytes, flags, ctypes.byref(out))
            super().__init__(lib, out, host_readable)
        except BaseException:
            # An interrupt after the wrap succeeded: free it before letting go of the object
            # (a failed free keeps the object for good, as `free` does).
            self.handle = out if out.value is not None else None
            self.free()
            raise

    def free(self):
        """Waits for the copies queued on the wrapper and lets go of the object; idempotent.
        When the wait fails, the object is held for good (a copy may still use its memory)
        and the error is raised."""
        try:
            super().free()
        except BaseException:
            _KEPT_FOREVER.append((self._view, self._owner))
            self._view = self._owner = None
            raise
        self._let_go()

    def _let_go(self):
        view, self._view, self._owner = self._view, None, None
        if view is not None:
            _BUFFER_API[1](ctypes.byref(view))

    def write(self, data, offset=0):
        """As `Buffer.write`; a read-only wrapper raises ValueError."""
        if self.read_only:
            raise ValueError("wrap: this memory was wrapped read-only")
        super().write(data, offset)


class RingSlot(_Owned):
    """A host slot from `Ring.acquire`: write up to `size` bytes at `ptr` (or `write`), then
    `publish` (or `abandon`, which returns it unpublished). Leaving a `with` block without
    publishing abandons it."""

    def __init__(self, lib, handle, ptr, size):
        self.lib, self.handle, self.ptr, self.size = lib, handle, ptr, size

    def write(self, data, offset=0):
        """Copies `data` (bytes-like) into the slot at `offset`."""
        data = _bytes_like(data, "RingSlot.write")
        _uint(offset, 63, "RingSlot.write: offset")
        if offset + len(data) > self.size:
            raise ValueError(f"bytes {offset}..{offset + len(data)} of a {self.size}-byte slot")
        self._live()
        ctypes.memmove(self.ptr + offset, data, len(data))

    def publish(self, sequence, nbytes):
        """Queues the upload of the first `nbytes` with `sequence`; the slot is then the ring's."""
        handle = self._live()
        args = (handle, sequence, nbytes)
        # Checked while the slot is still this guard's: C takes it (publishes or gives it
        # back) on every path, Python's refusals happen before C.
        for value, what in ((sequence, "sequence"), (nbytes, "nbytes")):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{what} is {value!r}, not an int")
        self.lib.check_arguments("cuferry_ring_publish", args)
        self.handle = None
        self.lib.call("cuferry_ring_publish", *args)

    def abandon(self):
        """Gives the slot back unpublished; idempotent."""
        handle, self.handle = self.handle, None
        if handle is not None:
            self.lib.call("cuferry_ring_abandon", handle)

    def _live(self):
        if self.handle is None:
            raise ValueError("slot already published or abandoned")
        return self.handle

    def _finish(self):
        self.abandon()


class RingItem(_Owned):
    """A published slot from `Ring.next`, its upload ordered before the consumer stream's later
    work: `ptr` (device address), `sequence`, `nbytes`. `release` (or leaving a `with` block)
    records the consumed point on that stream and gives the slot back."""

    def __init__(self, lib, handle):
        self.lib, self.handle = lib, handle
        ptr, seq, n = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_size_t()
        lib.call("cuferry_ring_item_info", handle, ctypes.byref(ptr), ctypes.byref(seq), ctypes.byref(n))
        self.ptr, self.sequence, self.nbytes = ptr.value, seq.value, n.value

    def release(self):
        """Records the consumed point and returns the slot; idempotent."""
        handle, self.handle = self.handle, None
        if handle is not None:
            self.lib.call("cuferry_ring_release", handle)

    def _finish(self):
        self.release()


class _PyBuffer(ctypes.Structure):
    """CPython's `Py_buffer` (the buffer protocol's view of an object's memory). A view still
    held when it is collected (an interrupt between getting it and recording it, or during
    `_Sources.release`) is released then: `PyBuffer_Release` clears `obj`, so twice is once."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_void_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]

    def __del__(self):
        try:
            if self.obj and _BUFFER_API is not None:
                _BUFFER_API[1](ctypes.byref(self))
        except Exception:  # interpreter shutdown: nothing left to release into
            pass


def _buffer_api():
    """(PyObject_GetBuffer, PyBuffer_Release) as prototypes of our own (the shared
    `ctypes.pythonapi` functions keep their signatures), or None where the interpreter has no
    C API to call (items are then copied)."""
    api = getattr(ctypes, "pythonapi", None)
    if api is None or not hasattr(api, "PyObject_GetBuffer"):
        return None
    get = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
    release = ctypes.PYFUNCTYPE(None, ctypes.POINTER(_PyBuffer))
    return get(("PyObject_GetBuffer", api)), release(("PyBuffer_Release", api))


_BUFFER_API = _buffer_api()
_PYBUF_SIMPLE = 0  # contiguous bytes, no format: what the copy reads
# Items whose memory may change (anything but bytes) and are shorter than this are copied when
# pulled, so a batch can hold many; longer ones are read in place and published before the
# next item is pulled (copying them here would cost more than a call per item).
_COPY_BELOW = 1 << 20


def _immutable(data):
    """Whether `data`'s memory cannot change while it is held: bytes, or a memoryview of bytes."""
    return type(data) is bytes or (isinstance(data, memoryview) and type(data.obj) is bytes)


class _Sources:
    """The memory of a batch of ring items: each item's buffer is held (`PyObject_GetBuffer`,
    so it can be neither freed nor resized) until `release`, which runs only once the library
    call reading it has returned. Bytes are read in place; other buffers shorter than
    `_COPY_BELOW`, and any buffer that is not C-contiguous, are copied into bytes first; a
    longer buffer that may change is read in place, and `add` says the batch must end with
    it (the generator may refill it for its next item)."""

    def __init__(self):
        self.addresses, self.lengths, self.bytes = [], [], 0
        self._views, self._kept = [], []

    def add(self, data, index, slot_bytes):
        """Adds item `index`'s `data` (bytes-like, at most `slot_bytes`); returns True when it
        is held in place but may change, so the batch must be published before the next item
        is pulled."""
        mutable = not _immutable(data) and _BUFFER_API is not None  # else `_view` copies
        try:
            address, length = self._view(data)
        except (BufferError, ValueError):
            # Not C-contiguous (numpy says ValueError): copied, in C order.
            data, mutable = memoryview(data).tobytes(), False
            address, length = self._view(data)
        except TypeError as e:
            raise TypeError(f"produce: item {index}'s data is a {type(data).__name__}, not bytes-like") from e
        if length > slot_bytes:
            raise ValueError(f"produce: item {index} of {length} bytes does not fit a slot of {slot_bytes} bytes")
        if mutable and length < _COPY_BELOW:
            self._drop_last()
            data, mutable = memoryview(data).tobytes(), False
            address, length = self._view(data)
        self.addresses.append(address)
        self.lengths.append(length)
        self.bytes += length
        return mutable

    def _view(self, data):
        """(address, length) of `data`'s memory, held until `release`."""
        if _BUFFER_API is None:
            data = bytes(memoryview(data))
            pointer = ctypes.c_char_p(data)
            self._kept.append((data, pointer))
            return ctypes.cast(pointer, ctypes.c_void_p).value, len(data)
        view = _PyBuffer()
        _BUFFER_API[0](data, ctypes.byref(view), _PYBUF_SIMPLE)
        self._views.append(view)
        return view.buf, view.len

    def _drop_last(self):
        """Lets go of the buffer `_view` held last."""
        if _BUFFER_API is None:
            self._kept.pop()
        else:
            _BUFFER_API[1](ctypes.byref(self._views.pop()))

    def release(self):
        """Lets go of every buffer held; idempotent (an interrupted release leaves the rest to
        `_PyBuffer.__del__`)."""
        views, self._views, self._kept = self._views, [], []
        for view in views:
            _BUFFER_API[1](ctypes.byref(view))


class Ring(_Handle):
    """The slot ring (`cuferry_ring_create`): producers fill slots, consumers take them in
    order on their streams. Methods may be called from several threads, `free()` included."""

    _free = "cuferry_ring_destroy"

    def __init__(self, lib, device, depth, slot_bytes, fill_threads):
        out = ctypes.c_void_p()
        lib.call("cuferry_ring_create", device, depth, slot_bytes, fill_threads, ctypes.byref(out))
        super().__init__(lib, out)
        self.depth, self.slot_bytes = depth, slot_bytes
        self._calls = 0
        self._closing = False
        self._idle = threading.Condition()

    def _call(self, name, *args):
        """Calls `name` on the live ring, counted so that `free()` waits for it. Once `free()`
        has begun, and after it, calls raise `Closed` without reaching the C ring (so that
        `items()` and `produce` on other threads end as for a closed ring): `free()` waited only
        for the calls counted before it began, and destroys the ring outside the lock."""
        with self._idle:
            handle = self.handle
            if self._closing or handle is None:
                status = self.lib.const.CUFERRY_STATUS_CLOSED
                what = "the ring was freed" if handle is None else "the ring is being freed"
                raise Closed(name, status, "CUFERRY_STATUS_CLOSED", what)
            self._calls += 1
        try:
            return self.lib.call(name, handle, *args)
        finally:
            with self._idle:
                self._calls -= 1
                self._idle.notify_all()

    def free(self):
        """Closes the ring, waits for the calls in progress on other threads, and destroys it
        (slot and item objects still held stay usable); idempotent."""
        with self._idle:
            # Another thread freeing it: wait until it finished, or gave up (interrupted).
            self._idle.wait_for(lambda: self.handle is None or not self._closing)
            handle = self.handle
            if handle is None:
                return
            self._closing = True
            try:
                self.lib.call("cuferry_ring_close", handle)
                # The wait lets go of the lock: a second free() meanwhile sees `_closing`.
                self._idle.wait_for(lambda: self._calls == 0)
            except BaseException:
                # Interrupted (Ctrl-C): the ring stays live and closed; a later free() (or
                # garbage collection) tries again instead of waiting for this one for good.
                self._closing = False
                self._idle.notify_all()
                raise
        try:
            self.lib.call(self._free, handle)
        finally:
            with self._idle:
                self.handle = None
                self._idle.notify_all()

    def acquire(self, timeout=None):
        """The next free host slot, waiting up to `timeout` seconds (`Timeout`, or `WouldBlock`
        for 0)."""
        slot, ptr = ctypes.c_void_p(), ctypes.c_void_p()
        self._call("cuferry_ring_acquire", _micros(timeout), ctypes.byref(slot), ctypes.byref(ptr))
        return RingSlot(self.lib, slot, ptr.value, self.slot_bytes)

    # Items gathered for one library call at most: bounds the arrays and the calls' overhead
    # for small items (their bytes are bounded by the ring's size, see `produce`).
    _BATCH_ITEMS = 1024

    def produce(self, items, in_flight=None, timeout=None):
        """Publishes `items`, (sequence, bytes-like) pairs, in order, filling up to `in_flight`
        slots at once (default: the ring's depth; 0 counts as 1) on the fill threads, and
        returns how many it published (all of them). A wait for a free slot gives up after
        `timeout` seconds (`Timeout`, or `WouldBlock` for 0; default: waits for good).

        `items` is read as it goes, in batches handed to the library one call at a time: a batch
        holds up to about the ring's size in bytes (`depth * slot_bytes`, at most 1024 items),
        so a generator is not drained ahead of the consumers and its items are not all held at
        once. Data is any object of the buffer protocol (bytes, bytearray, memoryview, array,
        a NumPy array; not a str or a list of ints). Bytes are read in place. Any other buffer
        may change once `items` moves on (a generator may refill one buffer for its next
        item), so it is never held across a pull: under 1 MiB it is copied when pulled, and a
        longer one is read in place and its batch published before the next item is pulled
        (such items fill one slot per call, each on all the fill threads). A buffer that is
        not C-contiguous is copied. With `in_flight=1` every item is published before the next
        is pulled (a generator waiting for the consumer before it yields).

        Whatever is raised, the items published are the first `e.published` (an attribute of
        the exception), across batches: errors of the library (`CuferryError`), of `items`
        itself (anything its iterator raises), and ValueError or TypeError for an item that
        cannot be sent (a sequence that is not an unsigned 64-bit int, data that is not
        bytes-like or larger than a slot). The items of the batch being gathered when such an
        item or an error of `items` turns up are not published: `e.published` may be less
        than the items pulled, and a one-shot iterator resumes from index `e.published`, not
        from where it stopped."""
        total = 0
        batch = ctypes.c_uint64(0)  # published by the batch in progress: the library writes it
        try:
            ahead = self.depth if in_flight is None else _uint(in_flight, _SIZE_BITS, "produce: in_flight")
            micros = _micros(timeout)
            self._live()
            iterator = iter(items)
            while True:
                more = self._produce_batch(iterator, total, ahead, micros, batch)
                total, batch.value = total + batch.value, 0
                if not more:
                    return total
        except BaseException as e:
            try:
                e.published = total + batch.value
            except Exception:  # an exception class refusing attributes keeps its own error
                pass
            raise

    def _produce_batch(self, iterator, first, ahead, micros, published):
        """Pulls the next batch from `iterator` (item indices from `first`) and publishes it,
        the count published in `published` (a `c_uint64` the library writes on every path);
        returns whether `iterator` may hold more. The items' memory is let go before return."""
        limit = max(1, self.depth * self.slot_bytes)
        sources = _Sources()
        seqs, more = [], True
        try:
            while sources.bytes < limit and len(seqs) < self._BATCH_ITEMS:
                try:
                    seq, data = next(iterator)
                except StopIteration:
                    more = False
                    break
                i = first + len(seqs)
                seqs.append(_uint(seq, 64, f"produce: the sequence of item {i}"))
                if sources.add(data, i, self.slot_bytes) or ahead <= 1:
                    break  # published before `iterator` is asked for more
            n = len(seqs)
            if n == 0:
                return False
            args = ((ctypes.c_uint64 * n)(*seqs), (ctypes.c_void_p * n)(*sources.addresses),
                    (ctypes.c_size_t * n)(*sources.lengths), n, ahead, micros, ctypes.byref(published))
            self._call("cuferry_ring_produce_timeout", *args)
            return more
        finally:
            # The call returned, so every copy from the items is done (its contract).
            sources.release()

    def next(self, stream, timeout=None):
        """The next published item in order, ready for work queued on `stream` (`Closed` once
        closed and drained; `Timeout`, or `WouldBlock` for 0). When `stream` cannot be ordered
        after the upload, the error is raised and the item stays first in line."""
        item = ctypes.c_void_p()
        self._call("cuferry_ring_next", _handle(stream, Stream, "stream"), _micros(timeout), ctypes.byref(item))
        return RingItem(self.lib, item)

    def items(self, stream, timeout=None):
        """Items in order until the ring is closed and drained; each is released when the loop
        moves on."""
        while True:
            try:
                item = self.next(stream, timeout)
            except Closed:
                return
            with item:
                yield item

    def close(self):
        """Closes the ring: producers get `Closed`, consumers drain what was published."""
        self._call("cuferry_ring_close")

    def stats(self):
        """The ring's counters as a dict (occupancy, high_water, producer_waits, published,
        bytes)."""
        out = self.lib.structs["CuferryRingStats"]()
        self._call("cuferry_ring_stats", ctypes.byref(out))
        return {name: getattr(out, name) for name, _ in out._fields_}


# ---- halo packers -------------------------------------------------------------------------


def _bounds(region, what):
    """(start, end) pairs from `range`s, `slice`s or pairs, each of step 1."""
    out = []
    for r in region:
        if isinstance(r, (range, slice)):
            if r.step not in (None, 1) or r.start is None or r.stop is None:
                raise ValueError(f"{what}: {r!r} needs a start and a stop, and step 1")
            out.append((r.start, r.stop))
        else:
            start, end = r
            out.append((start, end))
    return out


class HaloExchange:
    """One exchange of one array, as the C ABI's `CuferryHaloExchange`: the array's layout
    (`element_size` bytes per element, `shape` outermost first, `strides` in elements or None
    for contiguous row-major), its horizontal dims (`x_dim`, `y_dim`, or None), the region
    packed (one `range`, `slice` or (start, end) per dim), the clockwise quarter turns applied
    while packing (`rotation`, 0 to 3) and the region unpacked into. The library checks the
    rest (regions inside the array, the turned pack shape equal to the unpack shape, one
    element size for all the exchanges of a packer)."""

    def __init__(self, element_size, shape, pack, unpack, strides=None, x_dim=None, y_dim=None, rotation=0):
        self.element_size, self.shape = element_size, list(shape)
        self.strides = None if strides is None else list(strides)
        self.pack, self.unpack = _bounds(pack, "pack"), _bounds(unpack, "unpack")
        self.x_dim, self.y_dim, self.rotation = x_dim, y_dim, rotation

    def _struct(self, lib):
        """The `CuferryHaloExchange`, after the checks ctypes would not make (it wraps negative
        numbers, and an index past the fixed arrays raises IndexError)."""
        n, most = len(self.shape), lib.const.CUFERRY_HALO_MAX_DIMS
        if not 1 <= n <= most:
            raise ValueError(f"a {n}-d array: halo arrays have 1 to {most} dims")
        strides = self.strides if self.strides is not None else [0] * n
        for what, values in (("strides", strides), ("pack", self.pack), ("unpack", self.unpack)):
            if len(values) != n:
                raise ValueError(f"{what} has {len(values)} entries for a {n}-d array")
        _uint(self.element_size, 32, "halo exchange: element_size (>= 0)")
        _uint(self.rotation, 32, "halo exchange: rotation (>= 0)")
        for v in [*self.shape, *strides, *(i for pair in self.pack + self.unpack for i in pair)]:
            _uint(v, _SIZE_BITS, "halo exchange: a size, stride or bound (>= 0)")
        for what, d in (("x_dim", self.x_dim), ("y_dim", self.y_dim)):
            if d is not None and not (isinstance(d, int) and not isinstance(d, bool) and 0 <= d < n):
                raise ValueError(f"{what} {d!r} of a {n}-d array")
        e = lib.structs["CuferryHaloExchange"]()
        e.element_size, e.ndim, e.rotation = self.element_size, n, self.rotation
        e.x_dim = -1 if self.x_dim is None else self.x_dim
        e.y_dim = -1 if self.y_dim is None else self.y_dim
        for d in range(n):
            e.shape[d], e.strides[d] = self.shape[d], strides[d]
            e.pack_start[d], e.pack_end[d] = self.pack[d]
            e.unpack_start[d], e.unpack_end[d] = self.unpack[d]
        return e


class HaloPacker(_Handle):
    """A halo packer (`cuferry_halo_packer_create`): packs every exchange's region of its array
    into one buffer and unpacks the received buffer, on the packer's stream. Arrays are
    `Buffer`s the packer reaches, one per exchange: from `Library.device_buffer`, or
    `Library.wrap` of the device's own memory (any buffer on the host backend)."""

    _free = "cuferry_halo_packer_destroy"

    def __init__(self, lib, device, exchanges):
        exchanges = list(exchanges)
        n = len(exchanges)
        table = (lib.structs["CuferryHaloExchange"] * n)(*(e._struct(lib) for e in exchanges))
        out = ctypes.c_void_p()
        lib.call("cuferry_halo_packer_create", device, table, n, ctypes.byref(out))
        super().__init__(lib, out)
        self.device, self.exchanges = device, n

    def _arrays(self, arrays):
        arrays = list(arrays)
        handles = [_handle(a, Buffer, f"array {i}").value for i, a in enumerate(arrays)]
        return (ctypes.c_void_p * len(arrays))(*handles), len(arrays)

    def pack(self, arrays):
        """Queues packing each exchange's region of `arrays[i]` into the pack buffer."""
        self.lib.call("cuferry_halo_pack", self._live(), *self._arrays(arrays))

    def unpack(self, arrays):
        """Queues unpacking the unpack buffer into each exchange's region of `arrays[i]`."""
        self.lib.call("cuferry_halo_unpack", self._live(), *self._arrays(arrays))

    def loopback(self):
        """Queues copying the pack buffer into the unpack buffer (one process as its own
        neighbour)."""
        self.lib.call("cuferry_halo_loopback", self._live())

    def synchronize(self):
        """Waits for the packer's queued work."""
        self.lib.call("cuferry_halo_synchronize", self._live())

    def pack_buffer(self):
        """Waits, then gives (address, bytes) of the pack buffer (device memory on CUDA): send
        from it, and wait for the send before the next `pack`."""
        ptr, n = ctypes.c_void_p(), ctypes.c_size_t()
        self.lib.call("cuferry_halo_pack_buffer", self._live(), ctypes.byref(ptr), ctypes.byref(n))
        return ptr.value, n.value

    def unpack_buffer(self):
        """Waits, then gives (address, bytes) of the unpack buffer, to receive into before
        `unpack`."""
        ptr, n = ctypes.c_void_p(), ctypes.c_size_t()
        self.lib.call("cuferry_halo_unpack_buffer", self._live(), ctypes.byref(ptr), ctypes.byref(n))
        return ptr.value, n.value

    def _host_buffer(self, which):
        if self.device != HOST:
            raise ValueError("the packer's buffers are device memory: use their addresses")
        return which()

    def read_packed(self):
        """The packed bytes, after the queued pack (host backend only)."""
        ptr, n = self._host_buffer(self.pack_buffer)
        return b"" if n == 0 else ctypes.string_at(ptr, n)

    def write_unpack(self, data):
        """Fills the unpack buffer with `data` (bytes-like), exactly its size (host backend
        only)."""
        data = _bytes_like(data, "HaloPacker.write_unpack")
        ptr, n = self._host_buffer(self.unpack_buffer)
        if len(data) != n:
            raise ValueError(f"{len(data)} bytes for a {n}-byte unpack buffer")
        if n:
            ctypes.memmove(ptr, data, n)


# ---- managed memory -----------------------------------------------------------------------


def _raw_stream(stream, device=None):
    """A `cudaStream_t` for the managed calls on memory of `device` (None: not known): None
    (the legacy default stream), a `Stream` (NULL for a host-backend one, whose pool takes no
    stream; refused for CUDA memory, where it would silently be the legacy stream) or an int
    handle."""
    if stream is None:
        return None
    if isinstance(stream, Stream):
        if stream.device == HOST:
            if device is not None and device != HOST:
                raise ValueError(f"a host-backend Stream for memory of CUDA device {device}")
            return None
        return stream.cuda_handle
    if isinstance(stream, _Handle):
        raise TypeError(f"stream {stream!r}: a {type(stream).__name__} where a Stream goes")
    if isinstance(stream, int) and not isinstance(stream, bool) and 0 <= stream < 2**64:
        return stream
    raise ValueError(f"stream {stream!r}: use None, a cuferry Stream or a cudaStream_t int")


def _foreign_stream(other, device):
    """The `cudaStream_t` of a stream of CUDA `device` to order with: a `torch.cuda.Stream`
    (its `cuda_stream`; 0 on PyTorch's default stream), a CuPy stream (its `ptr`), an object
    with the `__cuda_stream__` protocol, a cuferry CUDA `Stream` (its `cuda_handle`) or an int
    handle (0: the legacy default stream). A stream that names another device is refused."""
    if isinstance(other, Stream):
        if other.device != device:
            raise ValueError(f"{other!r} is a stream of device {other.device}, not {device}")
        return other.cuda_handle
    if isinstance(other, _Owned):
        raise TypeError(f"{other!r}: a {type(other).__name__} where a stream goes")
    # PyTorch names its device `device_index`, CuPy `device_id`.
    named = getattr(other, "device_index", getattr(other, "device_id", None))
    if isinstance(named, int) and not isinstance(named, bool) and named != device:
        raise ValueError(f"{other!r} is a stream of device {named}, not {device}")
    if hasattr(other, "__cuda_stream__"):
        protocol = other.__cuda_stream__()
        if not (isinstance(protocol, tuple) and len(protocol) == 2):
            raise ValueError(f"{other!r}.__cuda_stream__() gave {protocol!r}, not (version, handle)")
        other = protocol[1]
    elif hasattr(other, "cuda_stream"):
        other = other.cuda_stream
    elif type(other).__module__.split(".")[0] == "cupy" and "Stream" in type(other).__name__:
        # Only CuPy's streams: other CuPy objects (a MemoryPointer, an Event) have a `ptr` too.
        other = other.ptr
    if isinstance(other, int) and not isinstance(other, bool) and 0 <= other < 2**64:
        return other or None
    raise ValueError(
        f"stream {other!r}: use a torch.cuda.Stream, a CuPy stream, a cuferry Stream or a cudaStream_t int")


def _address(ptr):
    """The address of a `ManagedAllocation`, or `ptr` itself (an int below 2**64: ctypes would
    wrap a negative or larger one to another address)."""
    return ptr._live() if isinstance(ptr, ManagedAllocation) else _uint(ptr, 64, f"address {ptr!r}")


def _device_of(ptr):
    """The device of a `ManagedAllocation` (None for a plain address)."""
    return ptr.device if isinstance(ptr, ManagedAllocation) else None


class ManagedAllocation(_Owned):
    """Managed memory from `Library.managed_alloc`: `ptr`, `size`, `device`. `free()` (or leaving
    a `with` block, or garbage collection) frees it once, in order on its stream (or another
    given to `free`, ordered after the allocation): queue every use there first, or finish it.
    Once a `Stream` it was allocated on is freed (which then waits for its work), it is freed
    on the legacy default stream. A raw `cudaStream_t` it was allocated on must outlive it, or
    be replaced by a live stream given to `free`. A free that fails during garbage collection
    warns (ResourceWarning); the memory then stays allocated."""

    def __init__(self, lib, ptr, size, device, stream):
        self.lib, self.ptr, self.size, self.device, self._stream = lib, ptr, size, device, stream

    def _live(self):
        if self.ptr is None:
            raise ValueError("ManagedAllocation used after free()")
        return self.ptr

    def free(self, stream=None):
        """Frees the memory in order on `stream` (default: the allocation's); idempotent."""
        if self.ptr is None:
            return
        if stream is None:
            stream = self._stream
            if isinstance(stream, Stream) and stream.handle is None:
                stream = None  # freed, after waiting for its work (Stream.free)
        # Resolved first: a bad stream raises here and leaves the memory allocated.
        raw = _raw_stream(stream, self.device)
        ptr, self.ptr = self.ptr, None
        if isinstance(self._stream, Stream):
            self._stream._live_allocations -= 1
        self.lib.raw.cuferry_managed_free(ptr, self.size, self.device, raw)

    def _finish(self):
        self.free()

    def __del__(self):
        try:
            self._finish()
        except Exception as e:  # noqa: BLE001 - reported, not raised, from garbage collection
            try:
                warnings.warn(f"managed allocation of {self.size} bytes not freed: {e}", ResourceWarning)
            except Exception:  # interpreter shutdown
                pass
