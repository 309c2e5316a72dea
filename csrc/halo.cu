// halo.cu: halo pack/unpack kernels (see the halo section of cuferry_cuda.h).
//
// Rules:
//  - cuferry_cuda_halo_launch moves every region of an exchange set in ONE launch. The grid
//    is one wave of resident blocks (SMs x blocks per SM at the kernel's occupancy), never
//    more blocks than kThreads-unit rows of work. Block b owns the contiguous access units
//    [b * chunk, (b + 1) * chunk) of the launch's numbering, chunk = ceil(total / grid).
//  - A block's chunk meets one descriptor or a few: the block finds the first one together
//    (first_segment: one parallel read of the starts; inline launches carry it, computed on
//    the host by first_segment_from, which the emulation runs too) and walks the segments. In
//    a segment [lo, hi) thread t moves the units lo + t + i * kThreads, so consecutive threads
//    move consecutive units (coalesced on the packed side, and on the array side along
//    contiguous rows).
//  - Units of 4 to 16 bytes are staged: each round a thread issues kStageBytes of cp.async
//    copies into shared memory, waits, and stores them. Loads in flight then cost no
//    registers: a block keeps 16 KB in flight, where a register path kept about 2 KB, and the
//    H100 runs of the register kernels were bound by exactly that (ncu, 11.6 MB exchanges:
//    DRAM at 25-47% of peak, long-scoreboard stalls dominant, the same time for 1 to 8 loads
//    in flight per thread because registers capped the warps). Units of 1 and 2 bytes take
//    the register path (kRegisterInFlight loads before their stores).
//  - Which stage bytes a thread owns depends on the unit size. A block that passes from a
//    staged segment to one of another unit size therefore meets a barrier first: without
//    it, a warp already in the new segment would copy into bytes that another warp has
//    staged and not yet stored. The emulation checks this rule (StageRaceCheck).
//  - Per segment, the descriptor is read once into registers, and the unit size, the dim count
//    and the negation are fixed for the segment: the per-unit work is a template over the
//    unit size (1-16 bytes) and the dim count (1 to kRegisterDims dims kept in registers;
//    more dims are read from the table per unit), with divisions by multiply-shift (the
//    host's div_mul/div_shr) and no per-unit index math on the packed side (row-major: unit l
//    is at byte l * unit size of the slot).
//  - Negation happens at pack only, per element kind: floats flip the sign bit (bit-exact with
//    the CPU's `-x`), i32 wraps (i32::MIN stays), BITS elements are never negated.
//  - The per-thread program is __host__ __device__: cuferry_cuda_halo_emulate runs it on the
//    CPU over host memory (cp.async becomes a plain copy), for any grid size, so its
//    arithmetic is tested without a GPU.
//  - The table is read from device memory (cuferry_cuda_halo_launch) or, for up to
//    CUFERRY_HALO_INLINE_MAX_DESC descriptors, from the launch's parameters
//    (cuferry_cuda_halo_launch_inline: the same per-thread program over a __grid_constant__
//    copy, which spares each block the dependent device-memory loads of the table's starts
//    and fields before its first data load).
//  - Every launch goes through cf_launch and returns its own status.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "common.cuh"

namespace {

constexpr int kThreads = CUFERRY_HALO_BLOCK_THREADS;
// Bytes each thread stages in shared memory per round of the staged path (16 KB a block).
constexpr int kStageBytes = 64;
// Loads in flight per thread on the register path (units of 1 and 2 bytes).
constexpr int kRegisterInFlight = 4;
// Descriptors of more dims than this take the path that keeps no dims in registers.
constexpr int kRegisterDims = 3;

constexpr unsigned kSign32 = 0x80000000u;

#ifndef __CUDA_ARCH__  // the emulation is host code only
// The emulation's check of the stage rule (see the header comment): it runs a block's threads
// one after another, so it records, for each stage byte and each barrier interval of the
// block, which thread touched it; two threads in one interval could run at once on a GPU.
class StageRaceCheck {
 public:
  // Starts block `block`'s thread `thread` (its first interval).
  void begin(unsigned long long block, unsigned thread) {
    tag_ = block * kThreads + thread + 1;
    block_first_ = block * kThreads + 1;
    interval_ = 0;
  }
  // The running thread passed one of the block's barriers.
  void barrier() { ++interval_; }
  // The running thread touches stage bytes [offset, offset + bytes).
  void touch(size_t offset, size_t bytes) {
    if (owners_.size() <= interval_) {
      owners_.resize(interval_ + 1, std::vector<unsigned long long>(kThreads * kStageBytes, 0));
    }
    std::vector<unsigned long long> &owner = owners_[interval_];
    for (size_t i = offset; i < offset + bytes && i < owner.size(); ++i) {
      // A tag of an earlier block counts as free: each block's tags are new.
      if (owner[i] >= block_first_ && owner[i] != tag_) {
        raced_ = true;
      }
      owner[i] = tag_;
    }
  }
  bool raced() const { return raced_; }

 private:
  std::vector<std::vector<unsigned long long>> owners_;
  unsigned long long tag_ = 0;
  unsigned long long block_first_ = 1;
  size_t interval_ = 0;
  bool raced_ = false;
};

// The check of the emulation running on this CPU thread (null outside cuferry_cuda_halo_emulate).
thread_local StageRaceCheck *t_stage_check = nullptr;
#endif

// The block's barrier between staged segments (on the host: the emulation's record of it).
__host__ __device__ __forceinline__ void stage_barrier() {
#ifdef __CUDA_ARCH__
  __syncthreads();
#else
  if (t_stage_check != nullptr) {
    t_stage_check->barrier();
  }
#endif
}

// The running thread touches stage bytes [offset, offset + bytes) (a no-op on the device).
__host__ __device__ __forceinline__ void stage_touch(size_t offset, size_t bytes) {
#ifndef __CUDA_ARCH__
  if (t_stage_check != nullptr) {
    t_stage_check->touch(offset, bytes);
  }
#else
  (void)offset;
  (void)bytes;
#endif
}

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

// Byte offset of unit l of a descriptor on the array side.
template <int ND>
__host__ __device__ __forceinline__ long long array_offset(const Dims<ND> &g, long long l) {
  unsigned rest = static_cast<unsigned>(l);
  long long a = 0;
#pragma unroll
  for (int i = ND - 1; i > 0; --i) {
    const unsigned q = fast_div(rest, g.mul[i], g.shr[i]);
    a += static_cast<long long>(rest - q * g.extent[i]) * g.array_step[i];
    rest = q;
  }
  return a + static_cast<long long>(rest) * g.array_step[0];
}

// Moves the units lo + thread + i * kThreads below hi of one descriptor, F at a time: the
// loads of a group, then its stores.
template <int F, int ND, int B>
__host__ __device__ __forceinline__ void move_units(const cuferry_halo_desc &d, unsigned char *packed,
                                                    bool pack, long long lo, long long hi,
                                                    unsigned thread) {
  using T = typename Unit<B>::T;
  const Dims<ND> g = dims_of<ND>(d);
  unsigned char *const array = reinterpret_cast<unsigned char *>(d.array);
  unsigned char *const slot = packed + d.packed_offset;
  const Negation neg = negation_of(d);
  const bool negating = pack && d.negate != 0;
#pragma unroll 1
  for (long long l0 = lo + thread; l0 < hi; l0 += static_cast<long long>(kThreads) * F) {
    T v[F];
    T *dst[F];
#pragma unroll
    for (int j = 0; j < F; ++j) {
      const long long l = l0 + static_cast<long long>(j) * kThreads;
      dst[j] = nullptr;
      if (l >= hi) {
        continue;
      }
      const long long a = array_offset<ND>(g, l);
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

// Copies one unit of B (4, 8 or 16) bytes from global memory into the stage without holding
// it in registers (cp.async; plain on the host); async_wait waits for every copy the thread
// issued.
template <int B>
__host__ __device__ __forceinline__ void async_copy(typename Unit<B>::T *to, const typename Unit<B>::T *from) {
#ifdef __CUDA_ARCH__
  const unsigned shared = static_cast<unsigned>(__cvta_generic_to_shared(to));
  if constexpr (B == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared), "l"(from) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(shared), "l"(from), "n"(B)
                 : "memory");
  }
#else
  *to = *from;
#endif
}

__host__ __device__ __forceinline__ void async_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
#endif
}

// The path for units of 4 to 16 bytes: per round a thread copies kStageBytes / B units into
// its column of the block's stage with cp.async (no registers held per load, so a block keeps
// 16 KB of loads in flight where the register path kept about 2 KB), waits, then stores them.
// Stage layout: unit j of thread t at stage[(j * kThreads + t) * B] (conflict-free reads).
template <int ND, int B>
__host__ __device__ __forceinline__ void move_units_staged(const cuferry_halo_desc &d,
                                                           unsigned char *packed, bool pack,
                                                           long long lo, long long hi,
                                                           unsigned thread, unsigned char *stage) {
  using T = typename Unit<B>::T;
  constexpr int kGroup = kStageBytes / B;
  const Dims<ND> g = dims_of<ND>(d);
  unsigned char *const array = reinterpret_cast<unsigned char *>(d.array);
  unsigned char *const slot = packed + d.packed_offset;
  const Negation neg = negation_of(d);
  const bool negating = pack && d.negate != 0;
  T *const column = reinterpret_cast<T *>(stage) + thread;
#pragma unroll 1
  for (long long l0 = lo + thread; l0 < hi; l0 += static_cast<long long>(kThreads) * kGroup) {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const long long l = l0 + static_cast<long long>(j) * kThreads;
      if (l >= hi) {
        break;
      }
      const unsigned char *from = pack ? array + array_offset<ND>(g, l) : slot + l * B;
      stage_touch((static_cast<size_t>(j) * kThreads + thread) * B, B);
      async_copy<B>(column + j * kThreads, reinterpret_cast<const T *>(from));
    }
    async_wait();
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const long long l = l0 + static_cast<long long>(j) * kThreads;
      if (l >= hi) {
        break;
      }
      T v = column[j * kThreads];
      if (negating) {
        negate(v, neg);
      }
      unsigned char *to = pack ? slot + l * B : array + array_offset<ND>(g, l);
      *reinterpret_cast<T *>(to) = v;
    }
  }
}

// The same for descriptors of more dims than the register path takes: the dims are read
// from the table for every unit (few registers, more loads), one unit at a time.
template <int B>
__host__ __device__ __forceinline__ void move_units_many_dims(const cuferry_halo_desc &d,
                                                              unsigned char *packed, bool pack,
                                                              long long lo, long long hi,
                                                              unsigned thread) {
  using T = typename Unit<B>::T;
  unsigned char *const array = reinterpret_cast<unsigned char *>(d.array);
  unsigned char *const slot = packed + d.packed_offset;
  const int ndim = d.ndim;
  const long long unit_bytes = static_cast<long long>(d.unit_elems) * d.elem_size;
  const bool negating = pack && d.negate != 0;
#pragma unroll 1
  for (long long l = lo + thread; l < hi; l += kThreads) {
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

// Picks the path for a descriptor of ND dims (ND == 0: more than kRegisterDims) and B-byte
// units: staged for 4 to 16 bytes, registers with F loads in flight for 1 and 2.
template <int F, int ND, int B>
__host__ __device__ __forceinline__ void move_units_nd(const cuferry_halo_desc &d, unsigned char *packed,
                                                       bool pack, long long lo, long long hi,
                                                       unsigned thread, unsigned char *stage) {
  if constexpr (ND == 0) {
    move_units_many_dims<B>(d, packed, pack, lo, hi, thread);
  } else if constexpr (B >= 4) {
    move_units_staged<ND, B>(d, packed, pack, lo, hi, thread, stage);
  } else {
    move_units<F, ND, B>(d, packed, pack, lo, hi, thread);
  }
}

// The unit size of a descriptor whose segments take the staged path (3 or fewer dims, units
// of 4, 8 or 16 bytes: the choices of halo_thread, move_units_of and move_units_nd), else 0.
__host__ __device__ __forceinline__ int staged_unit(const cuferry_halo_desc &d) {
  const int unit = d.unit_elems * d.elem_size;
  const bool staged = d.ndim >= 1 && d.ndim <= kRegisterDims && (unit == 4 || unit == 8 || unit == 16);
  return staged ? unit : 0;
}

// Picks the unit size of a descriptor.
template <int F, int ND>
__host__ __device__ __forceinline__ void move_units_of(const cuferry_halo_desc &d, unsigned char *packed,
                                                       bool pack, long long lo, long long hi,
                                                       unsigned thread, unsigned char *stage) {
  switch (d.unit_elems * d.elem_size) {
    case 16:
      move_units_nd<F, ND, 16>(d, packed, pack, lo, hi, thread, stage);
      break;
    case 8:
      move_units_nd<F, ND, 8>(d, packed, pack, lo, hi, thread, stage);
      break;
    case 4:
      move_units_nd<F, ND, 4>(d, packed, pack, lo, hi, thread, stage);
      break;
    case 2:
      move_units_nd<F, ND, 2>(d, packed, pack, lo, hi, thread, stage);
      break;
    default:
      move_units_nd<F, ND, 1>(d, packed, pack, lo, hi, thread, stage);
      break;
  }
}

// The last descriptor starting at or before unit c0 (the same for every thread of the block;
// every thread must call it). The block reads kThreads starts at once and counts them with
// __syncthreads_count: one round trip to memory per 256 descriptors, where a binary search
// made log2(n_desc) dependent ones (each about a microsecond with the table out of cache, as
// it is once per time step). The host's answer is first_segment_from.
__device__ __forceinline__ int first_segment(const cuferry_halo_desc *__restrict__ table,
                                             int n_desc, long long c0, unsigned thread) {
  int starts_at_or_before = 0;
  for (int base = 0; base < n_desc; base += kThreads) {
    const int i = base + static_cast<int>(thread);
    const int here = __syncthreads_count(i < n_desc && table[i].unit_first <= c0);
    starts_at_or_before += here;
    if (here < kThreads) {
      break;  // the starts increase: no later one is at or before c0 (uniform in the block)
    }
  }
  return starts_at_or_before - 1;  // table[0].unit_first == 0 <= c0
}

// first_segment on the host, for unit c0 at or after the start of descriptor `d` (a
// previous answer, or 0): the starts increase, so blocks taken in order need one pass over
// the table in all.
inline int first_segment_from(const cuferry_halo_desc *table, int n_desc, long long c0, int d) {
  while (d + 1 < n_desc && table[d + 1].unit_first <= c0) {
    ++d;
  }
  return d;
}

// first_segment of blocks 0..grid (chunk units each), on the host, as bytes (n_desc <= 256).
inline void block_first_segments(const cuferry_halo_desc *table, int n_desc, long long chunk,
                                 unsigned grid, unsigned char *first) {
  int d = 0;
  for (unsigned b = 0; b < grid; ++b) {
    d = first_segment_from(table, n_desc, static_cast<long long>(b) * chunk, d);
    first[b] = static_cast<unsigned char>(d);
  }
}

// The program of thread `thread` of block `block` (units [block * chunk, + chunk) of the
// launch): every unit it owns, segment by segment, from descriptor `lo` (the block's
// first_segment). `stage`: the block's kThreads * kStageBytes bytes of staging (shared memory
// on the device), 16-byte aligned.
template <int F>
__host__ __device__ void halo_thread(const cuferry_halo_desc *__restrict__ table, int n_desc,
                                     long long total_units, long long chunk, unsigned char *packed,
                                     int direction, unsigned block, unsigned thread,
                                     unsigned char *stage, int lo) {
  const long long c0 = static_cast<long long>(block) * chunk;
  const long long c1 = c0 + chunk < total_units ? c0 + chunk : total_units;
  const bool pack = direction == CUFERRY_HALO_PACK;
  // The unit size of the block's last staged segment (0: none yet). Every test below depends
  // on the block and the table only, so every thread of the block takes the same branches
  // and meets the same barriers.
  int last_staged = 0;
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
    const int staged = staged_unit(desc);
    if (staged != 0) {
      if (last_staged != 0 && last_staged != staged) {
        stage_barrier();  // the stage's bytes change owners (see the header comment)
      }
      last_staged = staged;
    }
    const long long l0 = s0 - first;
    const long long l1 = s1 - first;
    static_assert(kRegisterDims == 3, "the switch below lists the register paths");
    switch (desc.ndim) {
      case 1:
        move_units_of<F, 1>(desc, packed, pack, l0, l1, thread, stage);
        break;
      case 2:
        move_units_of<F, 2>(desc, packed, pack, l0, l1, thread, stage);
        break;
      case 3:
        move_units_of<F, 3>(desc, packed, pack, l0, l1, thread, stage);
        break;
      default:
        move_units_of<F, 0>(desc, packed, pack, l0, l1, thread, stage);
        break;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    halo_kernel(const cuferry_halo_desc *__restrict__ table, int n_desc, long long total_units,
                long long chunk, unsigned char *packed, int direction) {
  __shared__ __align__(16) unsigned char stage[kThreads * kStageBytes];
  const long long c0 = static_cast<long long>(blockIdx.x) * chunk;
  halo_thread<kRegisterInFlight>(table, n_desc, total_units, chunk, packed, direction, blockIdx.x,
                                 threadIdx.x, stage, first_segment(table, n_desc, c0, threadIdx.x));
}

// Most blocks whose first descriptor an inline launch carries (the H100's one wave is 132 SMs
// x 4 blocks); a larger grid searches on the device as halo_kernel does.
constexpr int kInlineMaxGrid = 768;

// The descriptors of a launch passed by value (cuferry_cuda_halo_launch_inline), CAP at most,
// and each block's first descriptor (first_segment, computed on the host) when the grid has
// at most kInlineMaxGrid blocks.
template <int CAP>
struct InlineTable {
  static_assert(CAP <= 256, "first[] holds descriptor indices in bytes");
  cuferry_halo_desc desc[CAP];
  unsigned char first[kInlineMaxGrid];
};

// halo_kernel with its table in the launch's parameters. __grid_constant__ keeps the table in
// the parameter bank: the per-thread program reads it through a pointer, which without the
// qualifier would copy every byte of it into each thread's local memory first. A block's
// first descriptor is one read at an address uniform in the block (first_known), not
// first_segment's read of every start: indexed parameter reads at different addresses in a
// warp are served one address at a time.
template <int CAP>
__global__ void __launch_bounds__(kThreads)
    halo_kernel_inline(const __grid_constant__ InlineTable<CAP> table, int n_desc,
                       long long total_units, long long chunk, unsigned char *packed,
                       int direction, int first_known) {
  __shared__ __align__(16) unsigned char stage[kThreads * kStageBytes];
  const long long c0 = static_cast<long long>(blockIdx.x) * chunk;
  const int lo = first_known ? static_cast<int>(table.first[blockIdx.x])
                             : first_segment(table.desc, n_desc, c0, threadIdx.x);
  halo_thread<kRegisterInFlight>(table.desc, n_desc, total_units, chunk, packed, direction,
                                 blockIdx.x, threadIdx.x, stage, lo);
}

// Tables of up to 8 descriptors fit the classic 4 KB of parameters; larger ones take the
// 32 KB space of CUDA 12.1+.
constexpr int kInlineSmall = 8;
static_assert(sizeof(InlineTable<kInlineSmall>) + 64 <= 4096, "the small table fits 4 KB");
static_assert(sizeof(InlineTable<CUFERRY_HALO_INLINE_MAX_DESC>) + 64 <= 32764,
              "the largest inline table fits the 32 764 bytes of kernel parameters");

// Queues halo_kernel_inline<CAP> over a copy of `table` (n_desc <= CAP) and, for grids of at
// most kInlineMaxGrid blocks, each block's first descriptor: the caller's table is free once
// this returns. Returns the launch's status.
template <int CAP>
cuferry_status launch_inline(const cuferry_halo_desc *table, int n_desc, long long total_units,
                   long long chunk, unsigned char *packed, int direction, unsigned grid,
                   cudaStream_t stream) {
  InlineTable<CAP> t{};
  std::memcpy(t.desc, table, sizeof(cuferry_halo_desc) * static_cast<size_t>(n_desc));
  const int first_known = grid <= static_cast<unsigned>(kInlineMaxGrid) ? 1 : 0;
  if (first_known) {
    block_first_segments(table, n_desc, chunk, grid, t.first);
  }
  return cf_launch(halo_kernel_inline<CAP>, grid, kThreads, stream, t, n_desc, total_units, chunk,
                   packed, direction, first_known);
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

// A grid of at most `max_blocks` blocks for `total_units` units: *grid blocks (0 when there is
// nothing to do) of *chunk units each (the last one may have fewer). Also the checks shared
// by the launch and its emulation: the status of the first bad argument.
cuferry_status launch_grid(const cuferry_halo_desc *table, int32_t n_desc, int64_t total_units,
                           const void *packed, int32_t direction, long long max_blocks,
                           unsigned *grid, long long *chunk) {
  *grid = 0;
  *chunk = 0;
  if (direction != CUFERRY_HALO_PACK && direction != CUFERRY_HALO_UNPACK) {
    return CUFERRY_STATUS_BAD_ENUM;
  }
  if (total_units < 0 || n_desc < 0 || max_blocks < 1) {
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
  // About one unit per thread per block (blocks split the units evenly, so a block may get a
  // few units fewer than it has threads), at most `max_blocks` blocks.
  const long long rows = (total_units + kThreads - 1) / kThreads;
  const long long blocks = rows < max_blocks ? rows : max_blocks;
  const long long per_block = (total_units + blocks - 1) / blocks;
  const cuferry_status st = grid_of((total_units + per_block - 1) / per_block, grid);
  if (st != CUFERRY_STATUS_SUCCESS) {
    return st;
  }
  *chunk = per_block;
  return CUFERRY_STATUS_SUCCESS;
}

// Blocks of halo_kernel resident on the current device (`device`) at once: SMs times blocks
// per SM at the kernel's occupancy. Computed once per device and cached.
cuferry_status resident_blocks(int32_t device, long long *blocks) {
  constexpr int kCachedDevices = 64;
  static std::atomic<long long> cache[kCachedDevices];
  const bool cached = device >= 0 && device < kCachedDevices;
  if (cached) {
    const long long v = cache[device].load(std::memory_order_relaxed);
    if (v > 0) {
      *blocks = v;
      return CUFERRY_STATUS_SUCCESS;
    }
  }
  int sms = 0;
  int per_sm = 0;
  CF_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CF_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, halo_kernel, kThreads, 0));
  const long long v = static_cast<long long>(sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  if (cached) {
    cache[device].store(v, std::memory_order_relaxed);
  }
  *blocks = v;
  return CUFERRY_STATUS_SUCCESS;
}

// The checks and the grid of a launch on `device` (made current): *grid = 0 when there is
// nothing to launch. The checks run first, with any grid, so nothing touches the device for
// bad arguments.
cuferry_status prepare_launch(int32_t device, const cuferry_halo_desc *table, int32_t n_desc,
                              int64_t total_units, const void *packed, int32_t direction,
                              cuferry_stream stream, unsigned *grid, long long *chunk) {
  CF_REQUIRE(stream);
  cuferry_status st = launch_grid(table, n_desc, total_units, packed, direction, 1, grid, chunk);
  if (st != CUFERRY_STATUS_SUCCESS || *grid == 0) {
    return st;
  }
  CF_TRY(cudaSetDevice(device));
  long long resident = 0;
  st = resident_blocks(device, &resident);
  if (st != CUFERRY_STATUS_SUCCESS) {
    return st;
  }
  return launch_grid(table, n_desc, total_units, packed, direction, resident, grid, chunk);
}

#ifndef __CUDA_ARCH__
// Runs halo_thread<F> for every block and thread of the grid, one after the other.
// Returns whether the stage rule held (see StageRaceCheck).
template <int F>
bool emulate_with(const cuferry_halo_desc *table, int32_t n_desc, int64_t total_units,
                  long long chunk, unsigned char *packed, int32_t direction, unsigned grid) {
  alignas(16) static thread_local unsigned char stage[kThreads * kStageBytes];
  StageRaceCheck check;
  t_stage_check = &check;
  int lo = 0;
  for (unsigned b = 0; b < grid; ++b) {
    lo = first_segment_from(table, n_desc, static_cast<long long>(b) * chunk, lo);
    for (unsigned t = 0; t < static_cast<unsigned>(kThreads); ++t) {
      check.begin(b, t);
      halo_thread<F>(table, n_desc, total_units, chunk, packed, direction, b, t, stage, lo);
    }
  }
  t_stage_check = nullptr;
  return !check.raced();
}
#endif

}  // namespace

extern "C" {

cuferry_status cuferry_cuda_halo_launch(int32_t device, const cuferry_halo_desc *table, int32_t n_desc,
                                   int64_t total_units, void *packed, int32_t direction,
                                   cuferry_stream stream) {
  unsigned grid = 0;
  long long chunk = 0;
  const cuferry_status st =
      prepare_launch(device, table, n_desc, total_units, packed, direction, stream, &grid, &chunk);
  if (st != CUFERRY_STATUS_SUCCESS || grid == 0) {
    return st;
  }
  return cf_launch(halo_kernel, grid, kThreads, cf_stream(stream), table, n_desc, total_units, chunk,
                   static_cast<unsigned char *>(packed), direction);
}

cuferry_status cuferry_cuda_halo_launch_inline(int32_t device, const cuferry_halo_desc *table,
                                               int32_t n_desc, int64_t total_units, void *packed,
                                               int32_t direction, cuferry_stream stream) {
  if (n_desc > CUFERRY_HALO_INLINE_MAX_DESC) {
    return static_cast<cuferry_status>(cudaErrorInvalidValue);
  }
  unsigned grid = 0;
  long long chunk = 0;
  const cuferry_status st =
      prepare_launch(device, table, n_desc, total_units, packed, direction, stream, &grid, &chunk);
  if (st != CUFERRY_STATUS_SUCCESS || grid == 0) {
    return st;
  }
  unsigned char *const bytes = static_cast<unsigned char *>(packed);
  cudaStream_t s = cf_stream(stream);
  // The smallest capacity that holds the table: the launch copies every byte of it.
  if (n_desc <= kInlineSmall) {
    return launch_inline<kInlineSmall>(table, n_desc, total_units, chunk, bytes, direction, grid, s);
  }
  if (n_desc <= 16) {
    return launch_inline<16>(table, n_desc, total_units, chunk, bytes, direction, grid, s);
  }
  if (n_desc <= 32) {
    return launch_inline<32>(table, n_desc, total_units, chunk, bytes, direction, grid, s);
  }
  return launch_inline<CUFERRY_HALO_INLINE_MAX_DESC>(table, n_desc, total_units, chunk, bytes,
                                                     direction, grid, s);
}

#ifndef __CUDA_ARCH__  // host code only (emulate_with)
cuferry_status cuferry_cuda_halo_emulate(const cuferry_halo_desc *table, int32_t n_desc,
                                         int64_t total_units, void *packed, int32_t direction,
                                         int32_t in_flight, int32_t max_blocks) {
  if (in_flight != 1 && in_flight != 2 && in_flight != 4 && in_flight != 8) {
    return CUFERRY_STATUS_BAD_ENUM;
  }
  unsigned grid = 0;
  long long chunk = 0;
  cuferry_status st =
      launch_grid(table, n_desc, total_units, packed, direction, max_blocks, &grid, &chunk);
  if (st != CUFERRY_STATUS_SUCCESS || grid == 0) {
    return st;
  }
  unsigned char *const bytes = static_cast<unsigned char *>(packed);
  bool rule_held = false;
  // The race check's records grow with the grid: an allocation failure must not unwind
  // across the C boundary.
  try {
  switch (in_flight) {
    case 1:
      rule_held = emulate_with<1>(table, n_desc, total_units, chunk, bytes, direction, grid);
      break;
    case 4:
      rule_held = emulate_with<4>(table, n_desc, total_units, chunk, bytes, direction, grid);
      break;
    case 8:
      rule_held = emulate_with<8>(table, n_desc, total_units, chunk, bytes, direction, grid);
      break;
    default:
      rule_held = emulate_with<2>(table, n_desc, total_units, chunk, bytes, direction, grid);
      break;
  }
  } catch (const std::bad_alloc &) {
    return static_cast<cuferry_status>(cudaErrorMemoryAllocation);
  }
  return rule_held ? CUFERRY_STATUS_SUCCESS : CUFERRY_STATUS_STAGE_RACE;
}
#endif

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
      return cf_launch(seed_gather_kernel<unsigned long long>, grid, kThreads, s,
                       static_cast<const unsigned long long *>(src), indices, n,
                       static_cast<unsigned long long *>(dst), elem_kind, neg);
    case 4:
      return cf_launch(seed_gather_kernel<unsigned>, grid, kThreads, s,
                       static_cast<const unsigned *>(src), indices, n,
                       static_cast<unsigned *>(dst), elem_kind, neg);
    case 2:
      return cf_launch(seed_gather_kernel<unsigned short>, grid, kThreads, s,
                       static_cast<const unsigned short *>(src), indices, n,
                       static_cast<unsigned short *>(dst), elem_kind, neg);
    case 1:
      return cf_launch(seed_gather_kernel<unsigned char>, grid, kThreads, s,
                       static_cast<const unsigned char *>(src), indices, n,
                       static_cast<unsigned char *>(dst), elem_kind, neg);
    default:
      return CUFERRY_STATUS_BAD_ENUM;
  }
}

}  // extern "C"
