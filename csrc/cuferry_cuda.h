/*
 * cuferry_cuda.h: the internal C ABI of cuferry's CUDA library (the .cu files in csrc/).
 *
 * Rules every function here follows:
 *  1. It returns a cuferry_status: 0 on success, a CUDA runtime error code (cudaError_t, > 0)
 *     when a CUDA call failed, or a negative CUFERRY_STATUS_* code for cuferry's own checks.
 *  2. It never throws and never aborts; out-parameters are written only on success.
 *  3. A failed CUDA call's error is cleared from the thread's "last error" before returning
 *     (cudaGetLastError), so one failure never poisons the next call; a failure that did not
 *     set the last error leaves it as it was (another library's pending error stays). Sticky
 *     errors (a kernel fault) stay reported by CUDA itself on every later call, as CUDA defines.
 *  4. Functions that create or allocate take the device ordinal and make it current first.
 *  5. Handles are opaque pointers: cuferry_stream is a cudaStream_t, cuferry_event a cudaEvent_t.
 *  6. Function names start with cuferry_cuda_: the public C ABI (include/cuferry.h, exported by
 *     the Rust cdylib) owns the plain cuferry_ names, and the two link into one library.
 *
 * The header is plain C (no CUDA headers) so bindgen can read it without a toolkit; the Rust
 * bindings generated from it live in src/sys/bindings.rs and a test fails when they drift.
 * csrc/cuferry_absent.c implements every function with CUFERRY_STATUS_NOT_BUILT for builds
 * without nvcc.
 */
#ifndef CUFERRY_CUDA_H
#define CUFERRY_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** 0 on success, > 0 a cudaError_t, < 0 one of the CUFERRY_STATUS_* codes below. */
typedef int32_t cuferry_status;

/** Success. */
#define CUFERRY_STATUS_SUCCESS 0
/** The library was built without nvcc: no CUDA function is available. */
#define CUFERRY_STATUS_NOT_BUILT (-1)
/** A required pointer argument was NULL. */
#define CUFERRY_STATUS_NULL_ARGUMENT (-2)
/** An enum argument (copy kind, ...) was out of range. */
#define CUFERRY_STATUS_BAD_ENUM (-3)
/** cuferry_cuda_halo_emulate found two threads of a block using the same shared-memory stage
 *  bytes between two barriers: on a GPU they could run at once (a data race). */
#define CUFERRY_STATUS_STAGE_RACE (-4)

/** CUDA's cudaErrorNotReady: a query found work still pending. */
#define CUFERRY_CUDA_NOT_READY 600
/** CUDA's cudaErrorInsufficientDriver: no driver, or one older than the runtime. */
#define CUFERRY_CUDA_INSUFFICIENT_DRIVER 35
/** CUDA's cudaErrorNoDevice. */
#define CUFERRY_CUDA_NO_DEVICE 100

/** Host wait modes: the values of cudaDeviceScheduleAuto, Spin, Yield and BlockingSync. */
#define CUFERRY_HOST_WAIT_AUTO 0u
#define CUFERRY_HOST_WAIT_SPIN 1u
#define CUFERRY_HOST_WAIT_YIELD 2u
#define CUFERRY_HOST_WAIT_BLOCK 4u

/** Opaque stream handle (a cudaStream_t). */
typedef struct cuferry_stream_st *cuferry_stream;
/** Opaque event handle (a cudaEvent_t). */
typedef struct cuferry_event_st *cuferry_event;

/** Direction of a copy, mapped to cudaMemcpyKind. */
typedef enum cuferry_copy_kind {
  CUFERRY_COPY_HOST_TO_DEVICE = 1,
  CUFERRY_COPY_DEVICE_TO_HOST = 2,
  CUFERRY_COPY_DEVICE_TO_DEVICE = 3,
  CUFERRY_COPY_HOST_TO_HOST = 4,
  /** Direction inferred from the pointers (unified virtual addressing). */
  CUFERRY_COPY_DEFAULT = 5
} cuferry_copy_kind;

/** Flags for cuferry_cuda_pinned_alloc (cudaHostAlloc flags). */
#define CUFERRY_PINNED_PORTABLE 1u
#define CUFERRY_PINNED_MAPPED 2u
#define CUFERRY_PINNED_WRITE_COMBINED 4u

/** Flags for cuferry_cuda_host_register (cudaHostRegister flags). */
#define CUFERRY_REGISTER_PORTABLE 1u
#define CUFERRY_REGISTER_MAPPED 2u
#define CUFERRY_REGISTER_READ_ONLY 8u

/** What cuferry reports about one device; filled by cuferry_cuda_device_properties. */
typedef struct cuferry_device_props {
  /** NUL-terminated device name. */
  char name[256];
  /** Global memory in bytes. */
  size_t total_global_mem;
  int32_t compute_major;
  int32_t compute_minor;
  int32_t multiprocessor_count;
  /** Bytes of L2 cache. */
  int32_t l2_cache_size;
  int32_t pci_domain_id;
  int32_t pci_bus_id;
  int32_t pci_device_id;
  /** Number of copy engines (cudaDevAttrAsyncEngineCount). */
  int32_t async_engine_count;
  int32_t unified_addressing;
  int32_t managed_memory;
  int32_t concurrent_managed_access;
  int32_t pageable_memory_access;
  int32_t memory_pools_supported;
  int32_t host_register_supported;
  int32_t can_map_host_memory;
  int32_t integrated;
} cuferry_device_props;

/** A host function run by a stream after its earlier work, exactly once: `status` is 0, or the
 *  persistent CUDA error the stream hit before it (cudaStreamAddCallback's callback). */
typedef void (*cuferry_host_fn)(cuferry_status status, void *user_data);

/* ---- errors and versions ---------------------------------------------------------------- */

/** The CUDA name of a status ("cudaErrorNoDevice"), or a cuferry name for negative codes. Never NULL. */
const char *cuferry_cuda_status_name(cuferry_status status);
/** CUDA's description of a status, or cuferry's for negative codes. Never NULL. */
const char *cuferry_cuda_status_string(cuferry_status status);
/** Returns and clears the calling thread's last CUDA error (cudaGetLastError). */
cuferry_status cuferry_cuda_take_last_error(void);
/** The CUDA runtime version the library was linked against (e.g. 13000). */
cuferry_status cuferry_cuda_runtime_version(int32_t *version);
/** The installed driver's CUDA version, 0 when no driver is installed. */
cuferry_status cuferry_cuda_driver_version(int32_t *version);

/* ---- devices ------------------------------------------------------------------------------ */

cuferry_status cuferry_cuda_device_count(int32_t *count);
cuferry_status cuferry_cuda_device_properties(int32_t device, cuferry_device_props *props);
/** Free and total device memory in bytes (cudaMemGetInfo). */
cuferry_status cuferry_cuda_device_mem_info(int32_t device, size_t *free_bytes, size_t *total_bytes);
cuferry_status cuferry_cuda_device_synchronize(int32_t device);
/** Makes `device` current on the calling thread (cudaSetDevice): cuferry's own threads call it
 *  before querying or waiting for a device's events, so that a thread with no current device
 *  does not create a context on device 0 (which a process using other GPUs never asked for). */
cuferry_status cuferry_cuda_set_device(int32_t device);
/** The calling thread's current device (cudaGetDevice). */
cuferry_status cuferry_cuda_get_device(int32_t *device);
/** Whether the calling thread has a current CUDA context (cuCtxGetCurrent, found through the
 *  runtime's driver entry point; asking creates none). cudaGetDevice answers 0 on a thread
 *  with none, and setting that device back would create device 0's context. */
cuferry_status cuferry_cuda_thread_has_context(int32_t *has);
/** The lowest device whose primary context is active (cuDevicePrimaryCtxGetState through the
 *  driver entry point; asking creates none), or -1 when none is. */
cuferry_status cuferry_cuda_active_device(int32_t *device);
/** Whether `device` can access memory of `peer` directly (cudaDeviceCanAccessPeer). */
cuferry_status cuferry_cuda_device_can_access_peer(int32_t device, int32_t peer, int32_t *can_access);
/** Lets `device` access `peer`'s memory. Enabling twice is a success. */
cuferry_status cuferry_cuda_device_enable_peer_access(int32_t device, int32_t peer);
/** The most bytes the L2 cache of `device` fetches from DRAM per miss (cudaDeviceGetLimit,
 *  cudaLimitMaxL2FetchGranularity), read with `device` current. */
cuferry_status cuferry_cuda_device_get_l2_fetch_granularity(int32_t device, size_t *bytes);
/** Asks for an L2 fetch granularity of `bytes` (0..=128; a hint the driver may round) on
 *  `device` (cudaDeviceSetLimit): context-wide, for kernels launched afterwards. */
cuferry_status cuferry_cuda_device_set_l2_fetch_granularity(int32_t device, size_t bytes);
/** How a host thread waits for `device` (cudaGetDeviceFlags & cudaDeviceScheduleMask, read with
 *  `device` current): one of the CUFERRY_HOST_WAIT_* values. */
cuferry_status cuferry_cuda_device_get_host_wait(int32_t device, uint32_t *schedule);
/** Sets how host threads wait for `device` (cudaSetDeviceFlags with `device` current): the
 *  scheduling bits become `schedule`, one of CUFERRY_HOST_WAIT_*; cudaDeviceSyncMemops is kept
 *  as it was. The primary context's flags: every thread and library of the process using the
 *  device waits this way from then on. CUFERRY_STATUS_BAD_ENUM for another value. */
cuferry_status cuferry_cuda_device_set_host_wait(int32_t device, uint32_t schedule);

/* ---- streams ------------------------------------------------------------------------------ */

/** Creates a non-blocking stream on `device` (no implicit sync with the legacy default stream). */
cuferry_status cuferry_cuda_stream_create(int32_t device, int32_t priority, cuferry_stream *stream);
/** Destroys a stream; work already queued still completes (cudaStreamDestroy). */
cuferry_status cuferry_cuda_stream_destroy(cuferry_stream stream);
cuferry_status cuferry_cuda_stream_synchronize(cuferry_stream stream);
/** CUFERRY_STATUS_SUCCESS when all queued work is done, CUFERRY_CUDA_NOT_READY when not. */
cuferry_status cuferry_cuda_stream_query(cuferry_stream stream);
/** Makes future work on `stream` wait for the last record of `event`. */
cuferry_status cuferry_cuda_stream_wait_event(cuferry_stream stream, cuferry_event event);
/** Queues `fn(status, user_data)` on `stream` (cudaStreamAddCallback): it is called exactly once,
 *  also after a device error (cudaLaunchHostFunc's function would then never run, and what its
 *  `user_data` owns would leak). `fn` must not call CUDA. */
cuferry_status cuferry_cuda_stream_launch_host_fn(cuferry_stream stream, cuferry_host_fn fn,
                                             void *user_data);

/* ---- events ------------------------------------------------------------------------------- */

/** Creates an event on `device`; `timing` = 0 creates it with cudaEventDisableTiming. */
cuferry_status cuferry_cuda_event_create(int32_t device, int32_t timing, cuferry_event *event);
cuferry_status cuferry_cuda_event_destroy(cuferry_event event);
cuferry_status cuferry_cuda_event_record(cuferry_event event, cuferry_stream stream);
/** CUFERRY_STATUS_SUCCESS when the last record completed (or none was made), else NOT_READY. */
cuferry_status cuferry_cuda_event_query(cuferry_event event);
cuferry_status cuferry_cuda_event_synchronize(cuferry_event event);
/** Milliseconds between two completed records of timing events. */
cuferry_status cuferry_cuda_event_elapsed_ms(cuferry_event start, cuferry_event end, float *ms);

/* ---- memory ------------------------------------------------------------------------------- */

/** cudaMalloc on `device`. `bytes` = 0 yields NULL and success once `device` is made current. */
cuferry_status cuferry_cuda_device_alloc(int32_t device, size_t bytes, void **ptr);
/** cudaFree on `device`; NULL is a no-op. */
cuferry_status cuferry_cuda_device_free(int32_t device, void *ptr);
/** cudaHostAlloc with CUFERRY_PINNED_* flags, made with `device` current. */
cuferry_status cuferry_cuda_pinned_alloc(int32_t device, size_t bytes, uint32_t flags, void **ptr);
/** cudaFreeHost with `device` (the allocating device) current, so that a free on a thread that
 *  never used CUDA does not create device 0's context; NULL is a no-op. */
cuferry_status cuferry_cuda_pinned_free(int32_t device, void *ptr);
/** cudaHostRegister of caller memory with CUFERRY_REGISTER_* flags. */
cuferry_status cuferry_cuda_host_register(int32_t device, void *ptr, size_t bytes, uint32_t flags);
/** cudaHostUnregister with `device` (the registering device) current, as pinned_free. */
cuferry_status cuferry_cuda_host_unregister(int32_t device, void *ptr);

/** What memory an address lies in (cudaPointerGetAttributes' cudaMemoryType). */
typedef enum cuferry_pointer_type {
  /** Host memory CUDA does not know: pageable, or no memory at all. */
  CUFERRY_POINTER_UNREGISTERED = 0,
  /** Page-locked host memory (cudaHostAlloc, cudaHostRegister). */
  CUFERRY_POINTER_HOST = 1,
  /** Device memory. */
  CUFERRY_POINTER_DEVICE = 2,
  /** Managed memory. */
  CUFERRY_POINTER_MANAGED = 3,
} cuferry_pointer_type;

/** The memory `ptr` lies in (cudaPointerGetAttributes) and its device (-1 for unregistered
 *  memory; the device of the context that allocated or registered it otherwise). Asking needs
 *  a current context: on a thread without one, the runtime makes the current device's. */
cuferry_status cuferry_cuda_pointer_type(const void *ptr, cuferry_pointer_type *type, int32_t *device);

/* ---- copies -------------------------------------------------------------------------------- */

/** cudaMemcpyAsync of `bytes` in direction `kind` on `stream`. */
cuferry_status cuferry_cuda_memcpy_async(void *dst, const void *src, size_t bytes,
                                    cuferry_copy_kind kind, cuferry_stream stream);
/** cudaMemcpyPeerAsync between two devices' memory on `stream`. */
cuferry_status cuferry_cuda_memcpy_peer_async(void *dst, int32_t dst_device, const void *src,
                                         int32_t src_device, size_t bytes,
                                         cuferry_stream stream);
/** cudaMemcpyBatchAsync of `count` independent copies (`sizes[k]` bytes from `srcs[k]` to
 *  `dsts[k]`, any pointers under unified addressing) on `stream`, sources read in stream
 *  order. The copies of a batch run in no set order among themselves: no destination may
 *  overlap another copy's source or destination. `count` 0 queues nothing. */
cuferry_status cuferry_cuda_memcpy_batch_async(void *const *dsts, const void *const *srcs,
                                          const size_t *sizes, size_t count,
                                          cuferry_stream stream);
/** cudaMemsetAsync of device memory to the byte `value`. */
cuferry_status cuferry_cuda_memset_async(void *dst, int32_t value, size_t bytes,
                                    cuferry_stream stream);

/* ---- managed memory (managed.cu) ---------------------------------------------------------- */

/** Opaque memory pool handle (a cudaMemPool_t). */
typedef struct cuferry_mem_pool_st *cuferry_mem_pool;

/** Location kinds, with cudaMemLocationType's values. */
#define CUFERRY_LOCATION_NONE 0
#define CUFERRY_LOCATION_DEVICE 1
#define CUFERRY_LOCATION_HOST 2
#define CUFERRY_LOCATION_HOST_NUMA 3
#define CUFERRY_LOCATION_HOST_NUMA_CURRENT 4

/** A place for managed pages: a cudaMemLocation (type is CUFERRY_LOCATION_*). */
typedef struct cuferry_location {
  int32_t type;
  int32_t id;
} cuferry_location;

/** Advice, with cudaMemoryAdvise's values. */
#define CUFERRY_ADVISE_SET_READ_MOSTLY 1
#define CUFERRY_ADVISE_UNSET_READ_MOSTLY 2
#define CUFERRY_ADVISE_SET_PREFERRED_LOCATION 3
#define CUFERRY_ADVISE_UNSET_PREFERRED_LOCATION 4
#define CUFERRY_ADVISE_SET_ACCESSED_BY 5
#define CUFERRY_ADVISE_UNSET_ACCESSED_BY 6

/** Byte counters of a memory pool (cudaMemPoolAttr*Mem*). */
typedef struct cuferry_pool_stats {
  uint64_t reserved_current;
  uint64_t reserved_high;
  uint64_t used_current;
  uint64_t used_high;
} cuferry_pool_stats;

/** Creates a managed memory pool (allocType managed) for `device`: with `device` as the
 *  preferred location when `prefer_device` is 1, with no preferred location when 0. `max_size`
 *  0 leaves the driver's default; `release_threshold` is cudaMemPoolAttrReleaseThreshold. */
cuferry_status cuferry_cuda_managed_pool_create(int32_t device, int32_t prefer_device, size_t max_size,
                                                uint64_t release_threshold, cuferry_mem_pool *pool);
/** Pools are never destroyed (a driver crashed in cudaMemPoolDestroy under load; see
 *  src/managed/pool.rs). Readies an idle pool (no allocation live, no free queued) for a new owner:
 *  cudaMemPoolTrimTo(0), and the reserved and used high-water marks reset to 0. */
cuferry_status cuferry_cuda_mem_pool_recycle(cuferry_mem_pool pool);
/** cudaMallocFromPoolAsync; `bytes` = 0 is CUFERRY_STATUS_NULL_ARGUMENT's sibling: rejected
 *  with cudaErrorInvalidValue by CUDA, so callers check first. */
cuferry_status cuferry_cuda_mem_pool_alloc_async(cuferry_mem_pool pool, size_t bytes,
                                                 cuferry_stream stream, void **ptr);
/** cudaFreeAsync. */
cuferry_status cuferry_cuda_free_async(void *ptr, cuferry_stream stream);
cuferry_status cuferry_cuda_mem_pool_stats(cuferry_mem_pool pool, cuferry_pool_stats *stats);
/** cudaMallocManaged (cudaMemAttachGlobal) on `device`: the fallback where pools are refused. */
cuferry_status cuferry_cuda_malloc_managed(int32_t device, size_t bytes, void **ptr);
/** cudaMemPrefetchAsync to `location`. */
cuferry_status cuferry_cuda_mem_prefetch_async(const void *ptr, size_t bytes, cuferry_location location,
                                               cuferry_stream stream);
/** cudaMemPrefetchBatchAsync: `count` ranges; `locations[k]` applies from range
 *  `location_starts[k]` (the first is 0, strictly increasing) to the next start. At most 64
 *  locations (cudaErrorInvalidValue past that); an empty batch (`count` and `n_locations` 0)
 *  queues nothing. */
cuferry_status cuferry_cuda_mem_prefetch_batch_async(void **ptrs, size_t *sizes, size_t count,
                                                     cuferry_location *locations,
                                                     size_t *location_starts, size_t n_locations,
                                                     cuferry_stream stream);
/** cudaMemDiscardBatchAsync. */
cuferry_status cuferry_cuda_mem_discard_batch_async(void **ptrs, size_t *sizes, size_t count,
                                                    cuferry_stream stream);
/** cudaMemDiscardAndPrefetchBatchAsync, arguments as for the prefetch batch. */
cuferry_status cuferry_cuda_mem_discard_and_prefetch_batch_async(void **ptrs, size_t *sizes, size_t count,
                                                                 cuferry_location *locations,
                                                                 size_t *location_starts,
                                                                 size_t n_locations,
                                                                 cuferry_stream stream);
/** cudaMemAdvise on each of `count` ranges (CUDA has no batched form); stops at the first
 *  failure. */
cuferry_status cuferry_cuda_mem_advise_ranges(void **ptrs, size_t *sizes, size_t count, int32_t advice,
                                              cuferry_location location);
/** Test and benchmark kernels: `data[i] = seed * 2654435761 + i` (mod 2^32), and the 64-bit sum
 *  of `data[0..n)` into the device (or managed) word `*sum`. One launch each, errors checked. */
cuferry_status cuferry_cuda_fill_pattern_u32(uint32_t *data, size_t n, uint32_t seed,
                                             cuferry_stream stream);
cuferry_status cuferry_cuda_sum_u32(const uint32_t *data, size_t n, unsigned long long *sum,
                                    cuferry_stream stream);

/* ---- linear-operator kernels (linop.cu) ----------------------------------------------------- */

/** Most loop dimensions of a linop kernel. */
#define CUFERRY_LINOP_MAX_DIMS 8
/** Element types of the linop kernels. */
#define CUFERRY_LINOP_F32 1
#define CUFERRY_LINOP_F64 2
#define CUFERRY_LINOP_C32 3
#define CUFERRY_LINOP_C64 4

/** A strided element-wise map over `shape`: dst[dst_offset + i.dst_strides] (= or +=)
 *  alpha * src[src_offset + i.src_strides], strides and offsets in elements. */
typedef struct cuferry_linop_map {
  int64_t shape[CUFERRY_LINOP_MAX_DIMS];
  int64_t src_strides[CUFERRY_LINOP_MAX_DIMS];
  int64_t dst_strides[CUFERRY_LINOP_MAX_DIMS];
  int64_t src_offset;
  int64_t dst_offset;
  int32_t ndim;
  int32_t accumulate;
} cuferry_linop_map;

/** A contraction over loop dims: out[i.out_strides] = sum over the dims whose out stride is 0
 *  of w'[w_offset + i.w_strides] * x[x_offset + i.x_strides] (w' = conj(w) when `conj`). The
 *  output (row-major over the dims with a non-zero out stride) is written, not accumulated. */
typedef struct cuferry_linop_contraction {
  int64_t shape[CUFERRY_LINOP_MAX_DIMS];
  int64_t out_strides[CUFERRY_LINOP_MAX_DIMS];
  int64_t x_strides[CUFERRY_LINOP_MAX_DIMS];
  int64_t w_strides[CUFERRY_LINOP_MAX_DIMS];
  int64_t x_offset;
  int64_t w_offset;
  int32_t ndim;
  int32_t conj;
} cuferry_linop_contraction;

/** The strided map for element type `dtype` (CUFERRY_LINOP_*), alpha = alpha_re + i alpha_im
 *  (real types use alpha_re). One launch, errors checked; none for an empty shape, which
 *  touches neither pointer (an empty buffer's is NULL). */
cuferry_status cuferry_cuda_linop_map(int32_t dtype, const cuferry_linop_map *map, const void *src, void *dst,
                                      double alpha_re, double alpha_im, cuferry_stream stream);
/** The contraction for element type `dtype`: one thread per output element. No launch for
 *  no outputs; an empty reduction writes zeros and reads neither `x` nor `w` (NULL there). */
cuferry_status cuferry_cuda_linop_contract(int32_t dtype, const cuferry_linop_contraction *c, const void *x,
                                           const void *w, void *out, cuferry_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* CUFERRY_CUDA_H */

/* ---- halo pack/unpack (csrc/halo.cu) ------------------------------------------------------
 * A second guarded block, appended after the main one so that the lines above stay as they
 * are; it relies on the typedefs above (the header is always included whole).
 *
 * Rules:
 *  1. One launch moves every region of an exchange set: a table of cuferry_halo_desc in device
 *     memory, one entry per (array, region), read by every block of the kernel.
 *  2. A descriptor is a strided copy between an array region and a slot of the packed buffer,
 *     in units of `elem_size` bytes (1, 2, 4 or 8). Rotations and flips are already folded
 *     into signed array strides and the array address by the caller; the packed side is
 *     row-major. Direction CUFERRY_HALO_PACK copies array -> packed (negating when `negate`),
 *     CUFERRY_HALO_UNPACK copies packed -> array (never negates).
 *  3. Work is numbered in access units of `unit_elems` elements (16-byte accesses where rows
 *     are contiguous and aligned): descriptor d covers units [unit_first, unit_first + units),
 *     descriptors in table order, without gaps, each with units > 0. The packed side is
 *     row-major and contiguous: unit l of a descriptor is at byte packed_offset + l * unit
 *     bytes (packed_stride says so too, and the kernel relies on it).
 *  4. Launch errors are reported (the launch's own status, never an earlier error another
 *     library left in the thread's last error); faults inside the kernel
 *     surface at the next synchronising call, as CUDA defines.
 */
#ifndef CUFERRY_CUDA_HALO_H
#define CUFERRY_CUDA_HALO_H

#ifdef __cplusplus
extern "C" {
#endif

/** Most dimensions a halo descriptor holds (after merging contiguous dims). */
#define CUFERRY_HALO_MAX_DIMS 8
/** Threads per block of the halo kernel. */
#define CUFERRY_HALO_BLOCK_THREADS 256

/** Directions of cuferry_cuda_halo_launch. */
#define CUFERRY_HALO_PACK 0
#define CUFERRY_HALO_UNPACK 1

/** Element kinds: how an element is negated. BITS elements are never negated. */
#define CUFERRY_HALO_KIND_BITS 0
#define CUFERRY_HALO_KIND_F32 1
#define CUFERRY_HALO_KIND_F64 2
#define CUFERRY_HALO_KIND_I32 3

/** One strided copy between an array region and a slot of the packed buffer. Integer fields
 *  only, no padding (Rust uploads it as bytes). */
typedef struct cuferry_halo_desc {
  /** Device address of the region's first element in output order (rotation folded in). */
  uint64_t array;
  /** Byte offset of the slot in the packed buffer. */
  int64_t packed_offset;
  /** First access unit of this descriptor in the launch's numbering. */
  int64_t unit_first;
  /** Number of access units (> 0, below 2^31: the kernel divides unit numbers within a
   *  descriptor by 32-bit multiply-shift; src/halo/gpu.rs refuses larger ones). */
  int64_t units;
  /** Strides in elements, outermost dim first; signed on the array side. */
  int64_t array_stride[CUFERRY_HALO_MAX_DIMS];
  int64_t packed_stride[CUFERRY_HALO_MAX_DIMS];
  /** Extents in elements, outermost first; the innermost is extent[ndim - 1]. Positive. */
  int32_t extent[CUFERRY_HALO_MAX_DIMS];
  int32_t ndim;
  /** Bytes per element: 1, 2, 4 or 8. */
  int32_t elem_size;
  /** CUFERRY_HALO_KIND_*. */
  int32_t elem_kind;
  /** 1: negate while packing. */
  int32_t negate;
  /** Elements per access unit; > 1 only when both innermost strides are 1 and aligned. */
  int32_t unit_elems;
  /** Access units per innermost row: extent[ndim - 1] / unit_elems. */
  int32_t row_units;
  /** Division by each dim's extent in units (extent[k]; row_units for the innermost), for
   *  every n < 2^31: n / e == (div_mul[k] == 0 ? n : umulhi(n, div_mul[k]) >> div_shr[k]).
   *  e == 1: div_mul = 0. e >= 2, with l = ceil(log2 e): div_mul = ceil(2^(31 + l) / e),
   *  div_shr = l - 1. */
  uint32_t div_mul[CUFERRY_HALO_MAX_DIMS];
  uint32_t div_shr[CUFERRY_HALO_MAX_DIMS];
} cuferry_halo_desc;

/** Runs every descriptor of `table` (device memory, `n_desc` entries covering `total_units`
 *  units) in ONE kernel launch on `stream` of `device`. `packed` is the packed buffer's device
 *  address; `direction` is CUFERRY_HALO_PACK or CUFERRY_HALO_UNPACK. total_units = 0 launches
 *  nothing. The grid is one wave of resident blocks (fewer for small exchanges). */
cuferry_status cuferry_cuda_halo_launch(int32_t device, const cuferry_halo_desc *table, int32_t n_desc,
                                   int64_t total_units, void *packed, int32_t direction,
                                   cuferry_stream stream);

/** Most descriptors cuferry_cuda_halo_launch_inline takes: 64 x 280 bytes travel in the
 *  launch's parameters (CUDA 12.1+ gives kernels up to 32 764 bytes of them on Volta and
 *  later). */
#define CUFERRY_HALO_INLINE_MAX_DESC 64

/** As cuferry_cuda_halo_launch, but `table` is host memory (n_desc <=
 *  CUFERRY_HALO_INLINE_MAX_DESC entries) copied into the launch's parameters: the kernel reads
 *  the descriptors from the parameter (constant) bank, so no block waits on device-memory
 *  loads of the table before its first data load. `table` may be reused once the call
 *  returns. n_desc above the maximum is cudaErrorInvalidValue, before anything is queued. */
cuferry_status cuferry_cuda_halo_launch_inline(int32_t device, const cuferry_halo_desc *table,
                                               int32_t n_desc, int64_t total_units, void *packed,
                                               int32_t direction, cuferry_stream stream);

/** Runs the kernel's per-thread program for every block and thread of a launch of at most
 *  `max_blocks` (>= 1) blocks, one after the other, on the calling CPU thread: the same code
 *  as the launch, over host memory (table, arrays and `packed` are host addresses), with
 *  `in_flight` (1, 2, 4 or 8) loads per thread in flight on the register path (units of 1
 *  and 2 bytes; the launch uses 4). For tests of the kernel's index
 *  arithmetic on machines without a GPU; not a fast path. It also checks the kernel's
 *  shared-memory rule: CUFERRY_STATUS_STAGE_RACE (after the whole run) when two threads of a
 *  block touched the same stage bytes between two of the block's barriers. Other arguments
 *  as for cuferry_cuda_halo_launch. */
cuferry_status cuferry_cuda_halo_emulate(const cuferry_halo_desc *table, int32_t n_desc,
                                         int64_t total_units, void *packed, int32_t direction,
                                         int32_t in_flight, int32_t max_blocks);

/** The seed's strategy, kept as a benchmark baseline: one launch gathering `n` elements
 *  `dst[i] = src[indices[i]]` (negated when `negate`, per `elem_kind`), with `indices` a flat
 *  int32 index array in device memory. */
cuferry_status cuferry_cuda_halo_seed_pack_launch(int32_t device, const void *src,
                                             const int32_t *indices, int64_t n, void *dst,
                                             int32_t elem_size, int32_t elem_kind, int32_t negate,
                                             cuferry_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* CUFERRY_CUDA_HALO_H */
