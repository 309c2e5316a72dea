"""cuferry's managed pool as PyTorch's allocator (run by tests/python_torch.rs).

Usage: python3 torch_allocator.py LIBCUFERRY_SO
A torch MemPool on CUDAPluggableAllocator(cuferry_managed_malloc, cuferry_managed_free)
allocates tensors whose results match ordinary CUDA tensors; cuferry then prefetches them to
the host and back in bulk (like the seed's module helpers, counting shared storage once) and
the results still match. Prints SKIP and exits 0 without torch or without CUDA.
"""
import ctypes
import sys

try:
    import torch
except ImportError:
    print("SKIP: torch is not installed")
    sys.exit(0)
if not torch.cuda.is_available():
    print("SKIP: torch sees no CUDA device")
    sys.exit(0)

path = sys.argv[1]
lib = ctypes.CDLL(path)


class Location(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("id", ctypes.c_int32)]


LOCATION_DEVICE, LOCATION_HOST = 1, 2
lib.cuferry_managed_prefetch_batch.restype = ctypes.c_int
lib.cuferry_managed_prefetch_batch.argtypes = [
    ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, Location, ctypes.c_void_p]
lib.cuferry_last_error_message.restype = ctypes.c_char_p


def prefetch_tensors(tensors, location):
    """One batched call for every distinct storage; returns the bytes prefetched."""
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    ptrs = (ctypes.c_void_p * len(storages))(*storages.keys())
    sizes = (ctypes.c_size_t * len(storages))(*storages.values())
    stream = torch.cuda.current_stream().cuda_stream
    status = lib.cuferry_managed_prefetch_batch(ptrs, sizes, len(storages), location, stream)
    if status != 0:
        raise RuntimeError(f"prefetch failed ({status}): {lib.cuferry_last_error_message().decode()}")
    return sum(storages.values())


allocator = torch.cuda.memory.CUDAPluggableAllocator(path, "cuferry_managed_malloc", "cuferry_managed_free")
pool = torch.cuda.MemPool(allocator.allocator())
torch.manual_seed(0)
a_ref = torch.randn(512, 768, device="cuda")
b_ref = torch.randn(768, 256, device="cuda")
c_ref = torch.relu(a_ref @ b_ref + 1.0)

with torch.cuda.use_mem_pool(pool):
    a = a_ref.clone()
    b = b_ref.clone()
    c = torch.relu(a @ b + 1.0)
    a_view = a[10:20]  # shares a's storage: counted once
torch.cuda.synchronize()
assert torch.allclose(c, c_ref, rtol=1e-5, atol=1e-5), "results from cuferry's pool differ"

moved = prefetch_tensors([a, b, c, a_view], Location(LOCATION_HOST, 0))
assert moved == a.untyped_storage().nbytes() + b.untyped_storage().nbytes() + c.untyped_storage().nbytes(), moved
torch.cuda.synchronize()
assert torch.equal(a.cpu(), a_ref.cpu()), "a changed on its way to the host"
prefetch_tensors([a, b, c], Location(LOCATION_DEVICE, torch.cuda.current_device()))
c2 = torch.relu(a @ b + 1.0)
torch.cuda.synchronize()
assert torch.allclose(c2, c_ref, rtol=1e-5, atol=1e-5), "results differ after the prefetch round trip"
del a, b, c, c2, a_view
print("torch allocator passed")
