// managed.cu: managed memory pools, stream-ordered allocation, prefetch (single and batched),
// discard, advise, pointer probing, and two small kernels the tests and benchmarks use.
//
// Rules: see cuferry_cuda.h. Every result is checked; a batch is one CUDA call (prefetch,
// discard) or one C call looping over CUDA's per-range call (advise, which has no batch form).
#include "common.cuh"

static cudaMemLocation cf_location(cuferry_location l) {
  cudaMemLocation loc = {};
  loc.type = static_cast<cudaMemLocationType>(l.type);
  loc.id = l.id;
  return loc;
}

static cudaMemPool_t cf_pool(cuferry_mem_pool p) { return reinterpret_cast<cudaMemPool_t>(p); }

extern "C" {

cuferry_status cuferry_cuda_managed_pool_create(int32_t device, int32_t prefer_device, size_t max_size,
                                                uint64_t release_threshold, cuferry_mem_pool *pool) {
  CF_REQUIRE(pool);
  CF_TRY(cudaSetDevice(device));
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypeManaged;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = prefer_device ? cudaMemLocationTypeDevice : cudaMemLocationTypeNone;
  props.location.id = prefer_device ? device : 0;
  props.maxSize = max_size;
  cudaMemPool_t p = nullptr;
  CF_TRY(cudaMemPoolCreate(&p, &props));
  unsigned long long threshold = release_threshold;
  cuferry_status s = cf_check(cudaMemPoolSetAttribute(p, cudaMemPoolAttrReleaseThreshold, &threshold));
  if (s != CUFERRY_STATUS_SUCCESS) {
    // Left alive, not destroyed: managed pools are never destroyed (src/managed/pool.rs, a
    // driver crash in cuMemPoolDestroy). This pool was never allocated from; it leaks.
    return s;
  }
  *pool = reinterpret_cast<cuferry_mem_pool>(p);
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_mem_pool_recycle(cuferry_mem_pool pool) {
  CF_REQUIRE(pool);
  const cudaMemPool_t p = cf_pool(pool);
  CF_TRY(cudaMemPoolTrimTo(p, 0));
  unsigned long long zero = 0;
  CF_TRY(cudaMemPoolSetAttribute(p, cudaMemPoolAttrReservedMemHigh, &zero));
  CF_TRY(cudaMemPoolSetAttribute(p, cudaMemPoolAttrUsedMemHigh, &zero));
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_mem_pool_alloc_async(cuferry_mem_pool pool, size_t bytes,
                                                 cuferry_stream stream, void **ptr) {
  CF_REQUIRE(pool);
  CF_REQUIRE(ptr);
  void *p = nullptr;
  CF_TRY(cudaMallocFromPoolAsync(&p, bytes, cf_pool(pool), cf_stream(stream)));
  *ptr = p;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_free_async(void *ptr, cuferry_stream stream) {
  CF_REQUIRE(ptr);
  return cf_check(cudaFreeAsync(ptr, cf_stream(stream)));
}

cuferry_status cuferry_cuda_mem_pool_stats(cuferry_mem_pool pool, cuferry_pool_stats *stats) {
  CF_REQUIRE(pool);
  CF_REQUIRE(stats);
  /* Read one by one while other threads allocate: each current before its high-water mark,
     used before reserved (an allocation reserves before it uses), so later reads cover
     earlier ones. */
  unsigned long long v[4] = {0, 0, 0, 0};
  const cudaMemPoolAttr attrs[4] = {cudaMemPoolAttrUsedMemCurrent, cudaMemPoolAttrReservedMemCurrent,
                                    cudaMemPoolAttrUsedMemHigh, cudaMemPoolAttrReservedMemHigh};
  for (int i = 0; i < 4; ++i) {
    CF_TRY(cudaMemPoolGetAttribute(cf_pool(pool), attrs[i], &v[i]));
  }
  stats->used_current = v[0];
  stats->reserved_current = v[1];
  stats->used_high = v[2];
  stats->reserved_high = v[3];
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_malloc_managed(int32_t device, size_t bytes, void **ptr) {
  CF_REQUIRE(ptr);
  CF_TRY(cudaSetDevice(device));
  void *p = nullptr;
  CF_TRY(cudaMallocManaged(&p, bytes, cudaMemAttachGlobal));
  *ptr = p;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_mem_prefetch_async(const void *ptr, size_t bytes, cuferry_location location,
                                               cuferry_stream stream) {
  CF_REQUIRE(ptr);
  return cf_check(cudaMemPrefetchAsync(ptr, bytes, cf_location(location), 0, cf_stream(stream)));
}

// Location tables of batched calls live on the stack up to this many entries.
#define CF_MAX_BATCH_LOCATIONS 64

// The prefetch function a batch goes to: cudaMemPrefetchBatchAsync or, when discarding first,
// cudaMemDiscardAndPrefetchBatchAsync (same parameters).
typedef cudaError_t (*cf_batch_prefetch_fn)(void **, size_t *, size_t, cudaMemLocation *, size_t *, size_t,
                                            unsigned long long, cudaStream_t);

// Checks a batch's arguments, converts its locations and runs `fn` on it.
static cuferry_status cf_prefetch_batch(cf_batch_prefetch_fn fn, void **ptrs, size_t *sizes, size_t count,
                                        cuferry_location *locations, size_t *location_starts,
                                        size_t n_locations, cuferry_stream stream) {
  CF_REQUIRE(ptrs);
  CF_REQUIRE(sizes);
  CF_REQUIRE(locations);
  CF_REQUIRE(location_starts);
  if (count == 0 && n_locations == 0) {
    return CUFERRY_STATUS_SUCCESS;  // an empty batch, as an empty discard batch
  }
  if (n_locations == 0 || n_locations > CF_MAX_BATCH_LOCATIONS || n_locations > count) {
    // Not an enum: the group count is out of range (at most CF_MAX_BATCH_LOCATIONS).
    return static_cast<cuferry_status>(cudaErrorInvalidValue);
  }
  cudaMemLocation locs[CF_MAX_BATCH_LOCATIONS];
  for (size_t i = 0; i < n_locations; ++i) {
    locs[i] = cf_location(locations[i]);
  }
  return cf_check(fn(ptrs, sizes, count, locs, location_starts, n_locations, 0, cf_stream(stream)));
}

cuferry_status cuferry_cuda_mem_prefetch_batch_async(void **ptrs, size_t *sizes, size_t count,
                                                     cuferry_location *locations,
                                                     size_t *location_starts, size_t n_locations,
                                                     cuferry_stream stream) {
  return cf_prefetch_batch(cudaMemPrefetchBatchAsync, ptrs, sizes, count, locations, location_starts,
                           n_locations, stream);
}

cuferry_status cuferry_cuda_mem_discard_batch_async(void **ptrs, size_t *sizes, size_t count,
                                                    cuferry_stream stream) {
  CF_REQUIRE(ptrs);
  CF_REQUIRE(sizes);
  return cf_check(cudaMemDiscardBatchAsync(ptrs, sizes, count, 0, cf_stream(stream)));
}

cuferry_status cuferry_cuda_mem_discard_and_prefetch_batch_async(void **ptrs, size_t *sizes, size_t count,
                                                                 cuferry_location *locations,
                                                                 size_t *location_starts,
                                                                 size_t n_locations,
                                                                 cuferry_stream stream) {
  return cf_prefetch_batch(cudaMemDiscardAndPrefetchBatchAsync, ptrs, sizes, count, locations,
                           location_starts, n_locations, stream);
}

cuferry_status cuferry_cuda_mem_advise_ranges(void **ptrs, size_t *sizes, size_t count, int32_t advice,
                                              cuferry_location location) {
  CF_REQUIRE(ptrs);
  CF_REQUIRE(sizes);
  if (advice < CUFERRY_ADVISE_SET_READ_MOSTLY || advice > CUFERRY_ADVISE_UNSET_ACCESSED_BY) {
    return CUFERRY_STATUS_BAD_ENUM;
  }
  for (size_t i = 0; i < count; ++i) {
    CF_TRY(cudaMemAdvise(ptrs[i], sizes[i], static_cast<cudaMemoryAdvise>(advice), cf_location(location)));
  }
  return CUFERRY_STATUS_SUCCESS;
}

__global__ void cf_fill_pattern_u32(uint32_t *data, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    data[i] = seed * 2654435761u + static_cast<uint32_t>(i);
  }
}

__global__ void cf_sum_u32(const uint32_t *data, size_t n, unsigned long long *sum) {
  __shared__ unsigned long long partial[256];
  unsigned long long acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    acc += data[i];
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      partial[threadIdx.x] += partial[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomicAdd(sum, partial[0]);
  }
}

static unsigned cf_blocks(size_t n) {
  size_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 1024 ? (blocks == 0 ? 1 : blocks) : 1024);
}

cuferry_status cuferry_cuda_fill_pattern_u32(uint32_t *data, size_t n, uint32_t seed, cuferry_stream stream) {
  if (n == 0) {
    return CUFERRY_STATUS_SUCCESS;
  }
  CF_REQUIRE(data);
  CF_TRY(cf_use_stream_device(cf_stream(stream)));
  return cf_launch(cf_fill_pattern_u32, cf_blocks(n), 256, cf_stream(stream), data, n, seed);
}

cuferry_status cuferry_cuda_sum_u32(const uint32_t *data, size_t n, unsigned long long *sum,
                                    cuferry_stream stream) {
  CF_REQUIRE(sum);
  if (n > 0) {
    CF_REQUIRE(data);  // before anything is queued: a refused call leaves *sum untouched
  }
  CF_TRY(cf_use_stream_device(cf_stream(stream)));
  CF_TRY(cudaMemsetAsync(sum, 0, sizeof(*sum), cf_stream(stream)));
  if (n == 0) {
    return CUFERRY_STATUS_SUCCESS;
  }
  return cf_launch(cf_sum_u32, cf_blocks(n), 256, cf_stream(stream), data, n, sum);
}

}  // extern "C"
