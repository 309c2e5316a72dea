// halo.cu: halo pack/unpack kernels (see the halo section of cuferry_cuda.h).
//
// Rules:
//  - cuferry_cuda_halo_launch moves every region of an exchange set in ONE launch. Block b
//    owns the access units [b * kUnitsPerBlock, (b + 1) * kUnitsPerBlock) of the launch's
//    numbering, and thread t of it the units b * kUnitsPerBlock + t + k * kThreads (k <
//    kUnitsPerThread), so consecutive threads move consecutive units (coalesced on the packed
//    side, and on the array side along contiguous rows).
//  - A block's chunk meets one descriptor or a few: each thread finds the first one by a
//    binary search over the table (the same for the whole block) and walks the segments.
//  - Per segment, the descriptor is read once into registers, and the unit size, the dim count
//    and the negation are fixed for the segment: the per-unit work is a template over the
//    unit size (1-16 bytes) and the dim count (1 to kRegisterDims dims kept in registers;
//    more dims are read from the table per unit), with divisions by multiply-shift (the
//    host's div_mul/div_shr) and no per-unit index math on the packed side (row-major: unit l
//    is at byte l * unit size of the slot). A thread issues F loads before their stores, F
//    from CUFERRY_HALO_IN_FLIGHT (1, 2 or 4; default 2). Registers (sm_90, ptxas -v): 48 / 64
//    / 80 for F = 1 / 2 / 4; the kernel this replaced used 32 but ran about 250 instructions
//    per unit (descriptor fields reloaded and divided per unit), this one about 60.
//  - Negation happens at pack only, per element kind: floats flip the sign bit (bit-exact with
//    the CPU's `-x`), i32 wraps (i32::MIN stays), BITS elements are never negated.
//  - The per-thread program is __host__ __device__: cuferry_cuda_halo_emulate runs it on the
//    CPU over host memory, so its arithmetic is tested without a GPU.
//  - Every launch is followed by cudaGetLastError, returned as the status.
#include <cstdlib>

#include "common.cuh"

namespace {

constexpr int kThreads = CUFERRY_HALO_BLOCK_THREADS;
constexpr int kUnitsPerThread = CUFERRY_HALO_UNITS_PER_THREAD;
constexpr long long kUnitsPerBlock = static_cast<long long>(kThreads) * kUnitsPerThread;
// Descriptors of more dims than this take the path that keeps no dims in registers.
constexpr int kRegisterDims = 3;

constexpr unsigned kSign32 = 0x80000000u;

// High 32 bits of a 32 x 32-bit product.
__host__ __device__ __forceinline__ unsigned mul_hi(unsigned a, unsigned b) {
#ifdef __CUDA_ARCH__
  return __umulhi(a, b);
#else
  return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
#endif
}

// n / e for n < 2^31, from the descriptor's multiplier and shift (mul == 0: e == 1).
__host__ __device__ __forceinline__ unsigned fast_div(unsigned n, unsigned mul, unsigned shr) {
  return mul == 0 ? n : (mul_hi(n, mul) >> shr);
}

// An access unit of B bytes, moved as 32-bit words where B >= 4.
template <int B>
struct Unit;
template <>
struct Unit<16> {
  using T = uint4;
};
template <>
struct Unit<8> {
  using T = uint2;
};
template <>
struct Unit<4> {
  using T = unsigned;
};
template <>
struct Unit<2> {
  using T = unsigned short;
};
template <>
struct Unit<1> {
  using T = unsigned char;
};

// How a segment negates its words: XOR with a per-word mask (floats: the sign bits), or
// two's-complement negation of every word (i32).
struct Negation {
  unsigned mask[4];
  bool wrap;
};

__host__ __device__ __forceinline__ unsigned neg_word(unsigned w, unsigned mask, bool wrap) {
  return wrap ? 0u - w : w ^ mask;
}

__host__ __device__ __forceinline__ void negate(uint4 &v, const Negation &n) {
  v.x = neg_word(v.x, n.mask[0], n.wrap);
  v.y = neg_word(v.y, n.mask[1], n.wrap);
  v.z = neg_word(v.z, n.mask[2], n.wrap);
  v.w = neg_word(v.w, n.mask[3], n.wrap);
}
__host__ __device__ __forceinline__ void negate(uint2 &v, const Negation &n) {
  v.x = neg_word(v.x, n.mask[0], n.wrap);
  v.y = neg_word(v.y, n.mask[1], n.wrap);
}
__host__ __device__ __forceinline__ void negate(unsigned &v, const Negation &n) {
  v = neg_word(v, n.mask[0], n.wrap);
}
// 1- and 2-byte units hold BITS elements, which are never negated.
__host__ __device__ __forceinline__ void negate(unsigned short &, const Negation &) {}
__host__ __device__ __forceinline__ void negate(unsigned char &, const Negation &) {}

// The negation of a descriptor's units (words little-endian: an f64's sign is in its odd word).
__host__ __device__ __forceinline__ Negation negation_of(const cuferry_halo_desc &d) {
  Negation n{{0u, 0u, 0u, 0u}, false};
  if (d.negate == 0) {
    return n;
  }
  for (int w = 0; w < 4; ++w) {
    if (d.elem_kind == CUFERRY_HALO_KIND_F32 || (d.elem_kind == CUFERRY_HALO_KIND_F64 && (w & 1))) {
      n.mask[w] = kSign32;
    }
  }
  n.wrap = d.elem_kind == CUFERRY_HALO_KIND_I32;
  return n;
}

// One descriptor's dims on the array side, in units and bytes, outermost first (the packed
// side needs none: unit l of a descriptor is at byte l * B of its slot).
template <int ND>
struct Dims {
  long long array_step[ND];   // bytes per index step, array side
  unsigned extent[ND];        // extent in units (the innermost: row_units)
  unsigned mul[ND];
  unsigned shr[ND];
};

// Loads the last `ndim` dims of `d` into the last slots of a Dims<ND> (ND >= ndim); the
// leading slots are extent 1 with zero steps.
template <int ND>
__host__ __device__ __forceinline__ Dims<ND> dims_of(const cuferry_halo_desc &d) {
  Dims<ND> g;
  const int ndim = d.ndim;
  const int unit_bytes = d.unit_elems * d.elem_size;
#pragma unroll
  for (int i = 0; i < ND; ++i) {
    const int k = i - (ND - ndim);  // the descriptor's dim in slot i
    if (k < 0) {
      g.array_step[i] = 0;
      g.extent[i] = 1;
      g.mul[i] = 0;
      g.shr[i] = 0;
      continue;
    }
    const long long bytes = (k == ndim - 1) ? unit_bytes : d.elem_size;
    g.array_step[i] = d.array_stride[k] * bytes;
    g.extent[i] = static_cast<unsigned>(k == ndim - 1 ? d.row_units : d.extent[k]);
    g.mul[i] = d.div_mul[k];
    g.shr[i] = d.div_shr[k];
  }
  return g;
}

// Moves the units base + k * kThreads (k < kUnitsPerThread) that lie in [lo, hi) of one
// descriptor, F at a time: the loads of a group, then its stores.
template <int F, int ND, int B>
__host__ __device__ __forceinline__ void move_units(const cuferry_halo_desc &d, unsigned char *packed,
                                                    bool pack, long long base, long long lo,
                                                    long long hi) {
  using T = typename Unit<B>::T;
  const Dims<ND> g = dims_of<ND>(d);
  unsigned char *const array = reinterpret_cast<unsigned char *>(d.array);
  unsigned char *const slot = packed + d.packed_offset;
  const Negation neg = negation_of(d);
  const bool negating = pack && d.negate != 0;
#pragma unroll
  for (int k0 = 0; k0 < kUnitsPerThread; k0 += F) {
    T v[F];
    T *dst[F];
#pragma unroll
    for (int j = 0; j < F; ++j) {
      const long long l = base + static_cast<long long>(k0 + j) * kThreads;
      dst[j] = nullptr;
      if (l < lo || l >= hi) {
        continue;
      }
      unsigned rest = static_cast<unsigned>(l);
      long long a = 0;
#pragma unroll
      for (int i = ND - 1; i > 0; --i) {
        const unsigned q = fast_div(rest, g.mul[i], g.shr[i]);
        const unsigned idx = rest - q * g.extent[i];
        a += static_cast<long long>(idx) * g.array_step[i];
        rest = q;
      }
      a += static_cast<long long>(rest) * g.array_step[0];
      const long long p = l * B;  // the packed side is row-major
      const T *src = reinterpret_cast<const T *>(pack ? array + a : slot + p);
      dst[j] = reinterpret_cast<T *>(pack ? slot + p : array + a);
      v[j] = *src;
    }
#pragma unroll
    for (int j = 0; j < F; ++j) {
      if (dst[j] != nullptr) {
        if (negating) {
          negate(v[j], neg);
        }
        *dst[j] = v[j];
      }
    }
  }
}

// The same for descriptors of more dims than the register path takes: the dims are read
// from the table for every unit (few registers, more loads), one unit at a time.
template <int B>
__host__ __device__ __forceinline__ void move_units_many_dims(const cuferry_halo_desc &d,
                                                              unsigned char *packed, bool pack,
                                                              long long base, long long lo,
                                                              long long hi) {
  using T = typename Unit<B>::T;
  unsigned char *const array = reinterpret_cast<unsigned char *>(d.array);
  unsigned char *const slot = packed + d.packed_offset;
  const int ndim = d.ndim;
  const long long unit_bytes = static_cast<long long>(d.unit_elems) * d.elem_size;
  const bool negating = pack && d.negate != 0;
#pragma unroll 1
  for (int k = 0; k < kUnitsPerThread; ++k) {
    const long long l = base + static_cast<long long>(k) * kThreads;
    if (l < lo || l >= hi) {
      continue;
    }
    unsigned rest = static_cast<unsigned>(l);
    long long a = 0;
#pragma unroll 1
    for (int i = ndim - 1; i > 0; --i) {
      const unsigned e = static_cast<unsigned>(i == ndim - 1 ? d.row_units : d.extent[i]);
      const unsigned q = fast_div(rest, d.div_mul[i], d.div_shr[i]);
      const long long step = d.array_stride[i] * (i == ndim - 1 ? unit_bytes : d.elem_size);
      a += static_cast<long long>(rest - q * e) * step;
      rest = q;
    }
    a += static_cast<long long>(rest) * d.array_stride[0] * (ndim == 1 ? unit_bytes : d.elem_size);
    unsigned char *const p = slot + l * B;
    const T *src = reinterpret_cast<const T *>(pack ? array + a : p);
    T *dst = reinterpret_cast<T *>(pack ? p : array + a);
    T v = *src;
    if (negating) {
      negate(v, negation_of(d));
    }
    *dst = v;
  }
}

// Picks the path for a descriptor of ND dims (ND == 0: more than kRegisterDims).
template <int F, int ND, int B>
__host__ __device__ __forceinline__ void move_units_nd(const cuferry_halo_desc &d, unsigned char *packed,
                                                       bool pack, long long base, long long lo,
                                                       long long hi) {
  if constexpr (ND == 0) {
    move_units_many_dims<B>(d, packed, pack, base, lo, hi);
  } else {
    move_units<F, ND, B>(d, packed, pack, base, lo, hi);
  }
}

// Picks the unit size of a descriptor.
template <int F, int ND>
__host__ __device__ __forceinline__ void move_units_of(const cuferry_halo_desc &d, unsigned char *packed,
                                                       bool pack, long long base, long long lo,
                                                       long long hi) {
  switch (d.unit_elems * d.elem_size) {
    case 16:
      move_units_nd<F, ND, 16>(d, packed, pack, base, lo, hi);
      break;
    case 8:
      move_units_nd<F, ND, 8>(d, packed, pack, base, lo, hi);
      break;
    case 4:
      move_units_nd<F, ND, 4>(d, packed, pack, base, lo, hi);
      break;
    case 2:
      move_units_nd<F, ND, 2>(d, packed, pack, base, lo, hi);
      break;
    default:
      move_units_nd<F, ND, 1>(d, packed, pack, base, lo, hi);
      break;
  }
}

// The program of thread `thread` of block `block`: every unit it owns, segment by segment,
// with F loads in flight.
template <int F>
__host__ __device__ void halo_thread(const cuferry_halo_desc *__restrict__ table, int n_desc,
                                     long long total_units, unsigned char *packed, int direction,
                                     unsigned block, unsigned thread) {
  const long long c0 = static_cast<long long>(block) * kUnitsPerBlock;
  const long long c1 = c0 + kUnitsPerBlock < total_units ? c0 + kUnitsPerBlock : total_units;
  // The last descriptor starting at or before c0 (the same for every thread of the block).
  int lo = 0;
  int hi = n_desc - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].unit_first <= c0) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const bool pack = direction == CUFERRY_HALO_PACK;
  const long long mine = c0 + thread;  // this thread's unit for k = 0
  for (int d = lo; d < n_desc; ++d) {
    const cuferry_halo_desc &desc = table[d];
    const long long first = desc.unit_first;
    if (first >= c1) {
      break;
    }
    const long long s0 = c0 > first ? c0 : first;
    const long long end = first + desc.units;
    const long long s1 = c1 < end ? c1 : end;
    if (s0 >= s1) {
      continue;
    }
    const long long base = mine - first;
    const long long l0 = s0 - first;
    const long long l1 = s1 - first;
    static_assert(kRegisterDims == 3, "the switch below lists the register paths");
    switch (desc.ndim) {
      case 1:
        move_units_of<F, 1>(desc, packed, pack, base, l0, l1);
        break;
      case 2:
        move_units_of<F, 2>(desc, packed, pack, base, l0, l1);
        break;
      case 3:
        move_units_of<F, 3>(desc, packed, pack, base, l0, l1);
        break;
      default:
        move_units_of<F, 0>(desc, packed, pack, base, l0, l1);
        break;
    }
  }
}

template <int F>
__global__ void __launch_bounds__(kThreads)
    halo_kernel(const cuferry_halo_desc *__restrict__ table, int n_desc, long long total_units,
                unsigned char *packed, int direction) {
  halo_thread<F>(table, n_desc, total_units, packed, direction, blockIdx.x, threadIdx.x);
}

// Loads in flight per thread: CUFERRY_HALO_IN_FLIGHT (1, 2 or 4), read once; 2 otherwise.
int in_flight() {
  static const int value = [] {
    const char *v = std::getenv("CUFERRY_HALO_IN_FLIGHT");
    const int n = v == nullptr ? 0 : std::atoi(v);
    return (n == 1 || n == 2 || n == 4) ? n : 2;
  }();
  return value;
}

template <typename T>
__device__ __forceinline__ T seed_negate(T v, int kind, bool negate) {
  if (!negate) {
    return v;
  }
  if constexpr (sizeof(T) == 8) {
    return kind == CUFERRY_HALO_KIND_F64 ? (v ^ 0x8000000000000000ull) : v;
  } else if constexpr (sizeof(T) == 4) {
    if (kind == CUFERRY_HALO_KIND_F32) {
      return v ^ 0x80000000u;
    }
    return kind == CUFERRY_HALO_KIND_I32 ? (0u - v) : v;
  } else {
    return v;
  }
}

// The seed's kernel: one thread per element, the source index read from a flat index array.
template <typename T>
__global__ void seed_gather_kernel(const T *__restrict__ src, const int32_t *__restrict__ indices,
                                   long long n, T *__restrict__ dst, int kind, bool negate) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    dst[i] = seed_negate<T>(src[indices[i]], kind, negate);
  }
}

// Grid size for `blocks` blocks, or cudaErrorInvalidValue when it does not fit.
cuferry_status grid_of(long long blocks, unsigned *grid) {
  if (blocks <= 0 || blocks > 0x7fffffffLL) {
    return static_cast<cuferry_status>(cudaErrorInvalidValue);
  }
  *grid = static_cast<unsigned>(blocks);
  return CUFERRY_STATUS_SUCCESS;
}

// The checks shared by the launch and its emulation: the grid for `total_units` units in
// *grid (0 when there is nothing to do), or the status of the first bad argument.
cuferry_status launch_grid(const cuferry_halo_desc *table, int32_t n_desc, int64_t total_units,
                           const void *packed, int32_t direction, unsigned *grid) {
  *grid = 0;
  if (direction != CUFERRY_HALO_PACK && direction != CUFERRY_HALO_UNPACK) {
    return CUFERRY_STATUS_BAD_ENUM;
  }
  if (total_units < 0 || n_desc < 0) {
    return static_cast<cuferry_status>(cudaErrorInvalidValue);
  }
  if (total_units == 0) {
    return CUFERRY_STATUS_SUCCESS;
  }
  CF_REQUIRE(table);
  CF_REQUIRE(packed);
  if (n_desc == 0) {
    return static_cast<cuferry_status>(cudaErrorInvalidValue);
  }
  cuferry_status st = grid_of((total_units + kUnitsPerBlock - 1) / kUnitsPerBlock, grid);
  if (st != CUFERRY_STATUS_SUCCESS) {
    return st;
  }
  return CUFERRY_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

cuferry_status cuferry_cuda_halo_launch(int32_t device, const cuferry_halo_desc *table, int32_t n_desc,
                                   int64_t total_units, void *packed, int32_t direction,
                                   cuferry_stream stream) {
  CF_REQUIRE(stream);
  unsigned grid = 0;
  cuferry_status st = launch_grid(table, n_desc, total_units, packed, direction, &grid);
  if (st != CUFERRY_STATUS_SUCCESS || grid == 0) {
    return st;
  }
  CF_TRY(cudaSetDevice(device));
  unsigned char *const bytes = static_cast<unsigned char *>(packed);
  cudaStream_t s = cf_stream(stream);
  switch (in_flight()) {
    case 1:
      halo_kernel<1><<<grid, kThreads, 0, s>>>(table, n_desc, total_units, bytes, direction);
      break;
    case 4:
      halo_kernel<4><<<grid, kThreads, 0, s>>>(table, n_desc, total_units, bytes, direction);
      break;
    default:
      halo_kernel<2><<<grid, kThreads, 0, s>>>(table, n_desc, total_units, bytes, direction);
      break;
  }
  return cf_check(cudaGetLastError());
}

cuferry_status cuferry_cuda_halo_emulate(const cuferry_halo_desc *table, int32_t n_desc,
                                         int64_t total_units, void *packed, int32_t direction,
                                         int32_t in_flight) {
  if (in_flight != 1 && in_flight != 2 && in_flight != 4) {
    return CUFERRY_STATUS_BAD_ENUM;
  }
  unsigned grid = 0;
  cuferry_status st = launch_grid(table, n_desc, total_units, packed, direction, &grid);
  if (st != CUFERRY_STATUS_SUCCESS || grid == 0) {
    return st;
  }
  unsigned char *const bytes = static_cast<unsigned char *>(packed);
  const int f = in_flight;
  for (unsigned b = 0; b < grid; ++b) {
    for (unsigned t = 0; t < static_cast<unsigned>(kThreads); ++t) {
      if (f == 1) {
        halo_thread<1>(table, n_desc, total_units, bytes, direction, b, t);
      } else if (f == 4) {
        halo_thread<4>(table, n_desc, total_units, bytes, direction, b, t);
      } else {
        halo_thread<2>(table, n_desc, total_units, bytes, direction, b, t);
      }
    }
  }
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_halo_seed_pack_launch(int32_t device, const void *src,
                                             const int32_t *indices, int64_t n, void *dst,
                                             int32_t elem_size, int32_t elem_kind, int32_t negate,
                                             cuferry_stream stream) {
  CF_REQUIRE(stream);
  if (n < 0) {
    return static_cast<cuferry_status>(cudaErrorInvalidValue);
  }
  if (n == 0) {
    return CUFERRY_STATUS_SUCCESS;
  }
  CF_REQUIRE(src);
  CF_REQUIRE(indices);
  CF_REQUIRE(dst);
  unsigned grid = 0;
  cuferry_status st = grid_of((n + kThreads - 1) / kThreads, &grid);
  if (st != CUFERRY_STATUS_SUCCESS) {
    return st;
  }
  CF_TRY(cudaSetDevice(device));
  cudaStream_t s = cf_stream(stream);
  const bool neg = negate != 0;
  switch (elem_size) {
    case 8:
      seed_gather_kernel<unsigned long long><<<grid, kThreads, 0, s>>>(
          static_cast<const unsigned long long *>(src), indices, n,
          static_cast<unsigned long long *>(dst), elem_kind, neg);
      break;
    case 4:
      seed_gather_kernel<unsigned><<<grid, kThreads, 0, s>>>(
          static_cast<const unsigned *>(src), indices, n, static_cast<unsigned *>(dst), elem_kind,
          neg);
      break;
    case 2:
      seed_gather_kernel<unsigned short><<<grid, kThreads, 0, s>>>(
          static_cast<const unsigned short *>(src), indices, n,
          static_cast<unsigned short *>(dst), elem_kind, neg);
      break;
    case 1:
      seed_gather_kernel<unsigned char><<<grid, kThreads, 0, s>>>(
          static_cast<const unsigned char *>(src), indices, n, static_cast<unsigned char *>(dst),
          elem_kind, neg);
      break;
    default:
      return CUFERRY_STATUS_BAD_ENUM;
  }
  return cf_check(cudaGetLastError());
}

}  // extern "C"
