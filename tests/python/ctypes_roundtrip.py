"""Uses cuferry's C ABI from Python through ctypes (run by tests/python_ctypes.rs).

Usage: python3 ctypes_roundtrip.py LIBCUFERRY_SO DEVICE   (DEVICE -1: host backend)
Round-trips bytes pinned -> device -> pinned and checks an error code; exits non-zero on failure.
"""
import ctypes
import sys

lib = ctypes.CDLL(sys.argv[1])
device = int(sys.argv[2])
OK, INVALID_ARGUMENT = 0, 1

lib.cuferry_version.restype = ctypes.c_char_p
lib.cuferry_last_error_message.restype = ctypes.c_char_p
lib.cuferry_buffer_ptr.restype = ctypes.c_void_p
lib.cuferry_buffer_ptr.argtypes = [ctypes.c_void_p]
for name in ("cuferry_stream_create", "cuferry_pinned_alloc", "cuferry_device_alloc", "cuferry_copy",
             "cuferry_buffer_synchronize", "cuferry_buffer_free", "cuferry_stream_destroy"):
    getattr(lib, name).restype = ctypes.c_int
lib.cuferry_pinned_alloc.argtypes = [ctypes.c_int32, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
lib.cuferry_device_alloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
lib.cuferry_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_size_t]
lib.cuferry_buffer_synchronize.argtypes = [ctypes.c_void_p]
lib.cuferry_buffer_free.argtypes = [ctypes.c_void_p]
lib.cuferry_stream_destroy.argtypes = [ctypes.c_void_p]


def ok(status):
    if status != OK:
        raise SystemExit(f"cuferry call failed ({status}): {lib.cuferry_last_error_message().decode()}")


print("cuferry", lib.cuferry_version().decode())
n = 1 << 20
stream, src, dev, back = (ctypes.c_void_p() for _ in range(4))
ok(lib.cuferry_stream_create(device, ctypes.byref(stream)))
ok(lib.cuferry_pinned_alloc(device, n, ctypes.byref(src)))
ok(lib.cuferry_device_alloc(stream, n, ctypes.byref(dev)))
ok(lib.cuferry_pinned_alloc(device, n, ctypes.byref(back)))
payload = bytes((i * 13 + 5) % 251 for i in range(n))
ctypes.memmove(lib.cuferry_buffer_ptr(src), payload, n)
ok(lib.cuferry_copy(stream, src, 0, dev, 0, n))
ok(lib.cuferry_copy(stream, dev, 0, back, 0, n))
ok(lib.cuferry_buffer_synchronize(back))
assert ctypes.string_at(lib.cuferry_buffer_ptr(back), n) == payload, "round trip differs"
assert lib.cuferry_copy(stream, src, n, back, 0, 1) == INVALID_ARGUMENT
for b in (src, dev, back):
    ok(lib.cuferry_buffer_free(b))
ok(lib.cuferry_stream_destroy(stream))
print("python ctypes round trip passed")
