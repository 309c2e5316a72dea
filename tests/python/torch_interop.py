"""PyTorch tensors through cuferry without staging copies, ordered with PyTorch's streams
without host waits (run by tests/python_torch.rs).

Usage: python3 torch_interop.py LIBCUFERRY_SO
- CUDA tensors wrapped by `lib.wrap` (their `__cuda_array_interface__`) and a CPU tensor's
  NumPy view are copied by cuferry; PyTorch reads the results.
- Ordering: a PyTorch stream sleeps on the GPU, then writes a tensor; a cuferry stream told
  to wait for it (`wait_cuda_stream`) copies that tensor into another, and the PyTorch stream,
  told to wait for the cuferry stream (`make_cuda_stream_wait`), reads the copy. Without the
  first wait the copy reads the old values; without the second the read sees the old copy.
  The same through PyTorch's default stream (`cuda_stream == 0`, the legacy stream), and
  through a version-3 `__cuda_array_interface__` whose `stream` names the writing stream.
- A slot ring consumed by PyTorch on its own stream: each item's upload waited for, its read
  waited for before the release.
Prints SKIP and exits 0 without torch or without CUDA.
"""
import os
import sys
import threading

try:
    import torch
except ImportError:
    print("SKIP: torch is not installed")
    sys.exit(0)
if not torch.cuda.is_available():
    print("SKIP: torch sees no CUDA device")
    sys.exit(0)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import cuferry  # noqa: E402

lib = cuferry.load(sys.argv[1])
DEVICE = 0
N = 1 << 20  # float32 elements
NBYTES = 4 * N
# About 50 ms of GPU time at the H100's clock: far longer than a queued copy takes to start.
SLEEP_CYCLES = 100_000_000


def check_order(torch_stream, wait_for_producer):
    """On `torch_stream`: sleep, then write `x`; cuferry copies `x` into `y` after
    `wait_for_producer(cuferry_stream)`; `torch_stream` waits for the copy and reads `y`."""
    x = torch.zeros(N, device="cuda")
    y = torch.full((N,), -1.0, device="cuda")
    torch.cuda.synchronize()
    with lib.stream(DEVICE) as s, lib.wrap(DEVICE, x) as wx, lib.wrap(DEVICE, y) as wy:
        with torch.cuda.stream(torch_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            x.fill_(7.0)
        wait_for_producer(s, wx)
        lib.copy(s, wx, wy, NBYTES)
        s.make_cuda_stream_wait(torch_stream)
        with torch.cuda.stream(torch_stream):
            seen = y.clone()
        torch.cuda.synchronize()
        s.synchronize()
    assert bool((seen == 7.0).all()), f"the copy was not ordered: {seen[:4].tolist()}"


side = torch.cuda.Stream()
check_order(side, lambda s, _: s.wait_cuda_stream(side))
default = torch.cuda.default_stream()
assert default.cuda_stream == 0, default.cuda_stream
check_order(default, lambda s, _: s.wait_cuda_stream(torch.cuda.current_stream()))


class Announced:
    """A tensor whose `__cuda_array_interface__` (version 3) names the stream writing it."""

    def __init__(self, tensor, stream):
        self.__cuda_array_interface__ = dict(tensor.__cuda_array_interface__, version=3,
                                             stream=stream.cuda_stream or 1)


def through_the_interface(torch_stream):
    """As `check_order`, the wait made by `lib.wrap` from the array's `stream` key: once
    through a given cuferry stream, once by the host."""
    for given in (True, False):
        x = torch.zeros(N, device="cuda")
        y = torch.full((N,), -1.0, device="cuda")
        torch.cuda.synchronize()
        with lib.stream(DEVICE) as s, lib.wrap(DEVICE, y) as wy:
            with torch.cuda.stream(torch_stream):
                torch.cuda._sleep(SLEEP_CYCLES)
                x.fill_(7.0)
            with lib.wrap(DEVICE, Announced(x, torch_stream), stream=s if given else None) as wx:
                lib.copy(s, wx, wy, NBYTES)
                s.synchronize()
            torch.cuda.synchronize()
            assert bool((y == 7.0).all()), f"wrap did not wait for the array's stream (given={given})"


through_the_interface(side)
through_the_interface(default)

# A CPU tensor's memory (through NumPy's buffer protocol) into a wrapped CUDA tensor.
cpu = torch.arange(N, dtype=torch.float32)
gpu = torch.zeros(N, device="cuda")
torch.cuda.synchronize()
with lib.stream(DEVICE) as s, lib.wrap(DEVICE, cpu.numpy()) as wc, lib.wrap(DEVICE, gpu) as wg:
    assert wc.read_only is False and wg.ptr == gpu.data_ptr()
    lib.copy(s, wc, wg, NBYTES)
    s.make_cuda_stream_wait(torch.cuda.current_stream())
    assert torch.equal(gpu.cpu(), cpu), "the CPU tensor did not arrive"


class DeviceBytes:
    """`nbytes` of device memory at `ptr`, as a CUDA array PyTorch can view."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2}


# A slot ring consumed by PyTorch on its own stream, as an RL learner's batches are: the
# torch stream waits for each item's upload, reads it late (after a GPU sleep), and the
# item's stream waits for that read before the release, so the slot is not uploaded into
# again under it. With two slots and sixteen items, a missing wait shows as wrong bytes.
DEPTH, SLOT, ITEMS = 2, 1 << 20, 16
payloads = [torch.randint(0, 256, (SLOT,), dtype=torch.uint8).numpy().tobytes() for _ in range(ITEMS)]
copies, failures = [], []
with lib.ring(DEVICE, DEPTH, SLOT, fill_threads=2) as ring, lib.stream(DEVICE) as s:
    def produce():
        try:
            ring.produce(enumerate(payloads))
        except BaseException as e:  # reported by the main thread
            failures.append(e)
        finally:
            ring.close()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    for item in ring.items(s, timeout=30):  # each item is released when the loop moves on
        assert item.sequence == len(copies) and item.nbytes == SLOT, (item.sequence, item.nbytes)
        s.make_cuda_stream_wait(side)
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES // 10)
            copies.append(torch.as_tensor(DeviceBytes(item.ptr, item.nbytes), device="cuda").clone())
        s.wait_cuda_stream(side)
    producer.join(timeout=30)
    s.synchronize()
torch.cuda.synchronize()
assert not failures, failures
assert len(copies) == ITEMS, len(copies)
for i, c in enumerate(copies):
    assert c.cpu().numpy().tobytes() == payloads[i], f"item {i} was read under a later upload or before its own"
print("torch interop passed")
