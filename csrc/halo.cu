// halo.cu: halo pack/unpack kernels (see the halo section of cuferry_cuda.h).
//
// Rules:
//  - cuferry_cuda_halo_launch moves every region of an exchange set in ONE launch: each block takes
//    a fixed chunk of the launch's access units, finds the descriptor of its first unit by a
//    binary search over the table, and each thread walks forward through the table as its units
//    advance (descriptors are laid out in unit order, without gaps).
//  - Within a descriptor, consecutive units are consecutive in the packed buffer (row-major), so
//    packed accesses are coalesced; array accesses are coalesced along contiguous rows and
//    strided (gathers) along rotated ones. Units are up to 16 bytes wide (uint4) where the
//    caller found rows contiguous and aligned.
//  - Negation happens at pack only, per element kind: floats flip the sign bit (bit-exact with
//    the CPU's `-x`), i32 wraps (i32::MIN stays), BITS elements are never negated.
//  - Every launch is followed by cudaGetLastError, returned as the status.
#include "common.cuh"

namespace {

constexpr int kThreads = CUFERRY_HALO_BLOCK_THREADS;
constexpr int kUnitsPerThread = CUFERRY_HALO_UNITS_PER_THREAD;
constexpr long long kUnitsPerBlock = static_cast<long long>(kThreads) * kUnitsPerThread;

// Negates the element lanes of one 32-bit word (word `index` of a unit, little-endian).
__device__ __forceinline__ unsigned neg_word(unsigned w, int index, int kind) {
  switch (kind) {
    case CUFERRY_HALO_KIND_F32:
      return w ^ 0x80000000u;
    case CUFERRY_HALO_KIND_F64:
      return (index & 1) ? (w ^ 0x80000000u) : w;  // the high word holds the sign
    case CUFERRY_HALO_KIND_I32:
      return 0u - w;
    default:
      return w;
  }
}

__device__ __forceinline__ void move_unit(const unsigned char *src, unsigned char *dst, int bytes,
                                          int kind, bool negate) {
  switch (bytes) {
    case 16: {
      uint4 v = *reinterpret_cast<const uint4 *>(src);
      if (negate) {
        v.x = neg_word(v.x, 0, kind);
        v.y = neg_word(v.y, 1, kind);
        v.z = neg_word(v.z, 2, kind);
        v.w = neg_word(v.w, 3, kind);
      }
      *reinterpret_cast<uint4 *>(dst) = v;
      break;
    }
    case 8: {
      uint2 v = *reinterpret_cast<const uint2 *>(src);
      if (negate) {
        v.x = neg_word(v.x, 0, kind);
        v.y = neg_word(v.y, 1, kind);
      }
      *reinterpret_cast<uint2 *>(dst) = v;
      break;
    }
    case 4: {
      unsigned v = *reinterpret_cast<const unsigned *>(src);
      if (negate) {
        v = neg_word(v, 0, kind);
      }
      *reinterpret_cast<unsigned *>(dst) = v;
      break;
    }
    case 2:
      *reinterpret_cast<unsigned short *>(dst) = *reinterpret_cast<const unsigned short *>(src);
      break;
    default:
      *dst = *src;
      break;
  }
}

// Moves unit `local` (numbered within descriptor `d`).
__device__ __forceinline__ void move_desc_unit(const cuferry_halo_desc &d, unsigned local,
                                               unsigned char *packed, int direction) {
  const int ndim = d.ndim;
  const unsigned row_units = static_cast<unsigned>(d.row_units);
  unsigned row = local / row_units;
  const unsigned col = local - row * row_units;
  const long long inner = static_cast<long long>(col) * d.unit_elems;
  long long a_off = inner * d.array_stride[ndim - 1];
  long long p_off = inner * d.packed_stride[ndim - 1];
  for (int k = ndim - 2; k >= 0; --k) {
    const unsigned e = static_cast<unsigned>(d.extent[k]);
    const unsigned q = row / e;
    const long long idx = static_cast<long long>(row - q * e);
    row = q;
    a_off += idx * d.array_stride[k];
    p_off += idx * d.packed_stride[k];
  }
  unsigned char *a = reinterpret_cast<unsigned char *>(d.array) + a_off * d.elem_size;
  unsigned char *p = packed + d.packed_offset + p_off * d.elem_size;
  const int bytes = d.unit_elems * d.elem_size;
  if (direction == CUFERRY_HALO_PACK) {
    move_unit(a, p, bytes, d.elem_kind, d.negate != 0);
  } else {
    move_unit(p, a, bytes, d.elem_kind, false);
  }
}

__global__ void __launch_bounds__(kThreads)
    halo_kernel(const cuferry_halo_desc *__restrict__ table, int n_desc, long long total_units,
                unsigned char *packed, int direction) {
  __shared__ int first_desc;
  const long long chunk = static_cast<long long>(blockIdx.x) * kUnitsPerBlock;
  if (threadIdx.x == 0) {
    int lo = 0;
    int hi = n_desc - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (table[mid].unit_first <= chunk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    first_desc = lo;
  }
  __syncthreads();
  int d = first_desc;
  for (int it = 0; it < kUnitsPerThread; ++it) {
    const long long u = chunk + static_cast<long long>(it) * kThreads + threadIdx.x;
    if (u >= total_units) {
      return;
    }
    while (d + 1 < n_desc && u >= table[d].unit_first + table[d].units) {
      ++d;
    }
    move_desc_unit(table[d], static_cast<unsigned>(u - table[d].unit_first), packed, direction);
  }
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

}  // namespace

extern "C" {

cuferry_status cuferry_cuda_halo_launch(int32_t device, const cuferry_halo_desc *table, int32_t n_desc,
                                   int64_t total_units, void *packed, int32_t direction,
                                   cuferry_stream stream) {
  CF_REQUIRE(stream);
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
  unsigned grid = 0;
  cuferry_status st = grid_of((total_units + kUnitsPerBlock - 1) / kUnitsPerBlock, &grid);
  if (st != CUFERRY_STATUS_SUCCESS) {
    return st;
  }
  CF_TRY(cudaSetDevice(device));
  halo_kernel<<<grid, kThreads, 0, cf_stream(stream)>>>(
      table, n_desc, total_units, static_cast<unsigned char *>(packed), direction);
  return cf_check(cudaGetLastError());
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
