// memory.cu: device and pinned allocation, host registration, async copies and memset.
//
// Rules: zero-byte allocations succeed with NULL and allocate nothing (after the device is made
// current, so a bad ordinal or missing driver still fails); freeing NULL is a no-op;
// copies and memsets are asynchronous on the given stream (the caller keeps both buffers alive
// until the stream has finished them).
#include "common.cuh"

extern "C" {

cuferry_status cuferry_cuda_device_alloc(int32_t device, size_t bytes, void **ptr) {
  CF_REQUIRE(ptr);
  // The device first, for zero bytes too: a missing driver or ordinal is an error either way.
  CF_TRY(cudaSetDevice(device));
  if (bytes == 0) {
    *ptr = nullptr;
    return CUFERRY_STATUS_SUCCESS;
  }
  void *p = nullptr;
  CF_TRY(cudaMalloc(&p, bytes));
  *ptr = p;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_device_free(int32_t device, void *ptr) {
  if (ptr == nullptr) {
    return CUFERRY_STATUS_SUCCESS;
  }
  CF_TRY(cudaSetDevice(device));
  return cf_check(cudaFree(ptr));
}

cuferry_status cuferry_cuda_pinned_alloc(int32_t device, size_t bytes, uint32_t flags, void **ptr) {
  CF_REQUIRE(ptr);
  CF_TRY(cudaSetDevice(device));  // as in cuferry_cuda_device_alloc
  if (bytes == 0) {
    *ptr = nullptr;
    return CUFERRY_STATUS_SUCCESS;
  }
  unsigned cuda_flags = cudaHostAllocDefault;
  if (flags & CUFERRY_PINNED_PORTABLE) cuda_flags |= cudaHostAllocPortable;
  if (flags & CUFERRY_PINNED_MAPPED) cuda_flags |= cudaHostAllocMapped;
  if (flags & CUFERRY_PINNED_WRITE_COMBINED) cuda_flags |= cudaHostAllocWriteCombined;
  void *p = nullptr;
  CF_TRY(cudaHostAlloc(&p, bytes, cuda_flags));
  *ptr = p;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_pinned_free(int32_t device, void *ptr) {
  if (ptr == nullptr) {
    return CUFERRY_STATUS_SUCCESS;
  }
  // With no current device (a fresh thread) the runtime would use, and create, device 0's
  // primary context: a multi-GPU process then holds memory on a device it never used.
  CF_TRY(cudaSetDevice(device));
  return cf_check(cudaFreeHost(ptr));
}

cuferry_status cuferry_cuda_host_register(int32_t device, void *ptr, size_t bytes, uint32_t flags) {
  CF_REQUIRE(ptr);
  unsigned cuda_flags = cudaHostRegisterDefault;
  if (flags & CUFERRY_REGISTER_PORTABLE) cuda_flags |= cudaHostRegisterPortable;
  if (flags & CUFERRY_REGISTER_MAPPED) cuda_flags |= cudaHostRegisterMapped;
  if (flags & CUFERRY_REGISTER_READ_ONLY) cuda_flags |= cudaHostRegisterReadOnly;
  CF_TRY(cudaSetDevice(device));
  return cf_check(cudaHostRegister(ptr, bytes, cuda_flags));
}

cuferry_status cuferry_cuda_host_unregister(int32_t device, void *ptr) {
  CF_REQUIRE(ptr);
  CF_TRY(cudaSetDevice(device));  // as in cuferry_cuda_pinned_free
  return cf_check(cudaHostUnregister(ptr));
}

cuferry_status cuferry_cuda_pointer_type(const void *ptr, cuferry_pointer_type *type, int32_t *device) {
  CF_REQUIRE(type);
  CF_REQUIRE(device);
  cudaPointerAttributes attr = {};
  CF_TRY(cudaPointerGetAttributes(&attr, ptr));
  switch (attr.type) {
    case cudaMemoryTypeHost:
      *type = CUFERRY_POINTER_HOST;
      break;
    case cudaMemoryTypeDevice:
      *type = CUFERRY_POINTER_DEVICE;
      break;
    case cudaMemoryTypeManaged:
      *type = CUFERRY_POINTER_MANAGED;
      break;
    default:
      *type = CUFERRY_POINTER_UNREGISTERED;
      break;
  }
  *device = attr.type == cudaMemoryTypeUnregistered ? -1 : attr.device;
  return CUFERRY_STATUS_SUCCESS;
}

static bool cf_copy_kind(cuferry_copy_kind kind, cudaMemcpyKind *out) {
  switch (kind) {
    case CUFERRY_COPY_HOST_TO_DEVICE:
      *out = cudaMemcpyHostToDevice;
      return true;
    case CUFERRY_COPY_DEVICE_TO_HOST:
      *out = cudaMemcpyDeviceToHost;
      return true;
    case CUFERRY_COPY_DEVICE_TO_DEVICE:
      *out = cudaMemcpyDeviceToDevice;
      return true;
    case CUFERRY_COPY_HOST_TO_HOST:
      *out = cudaMemcpyHostToHost;
      return true;
    case CUFERRY_COPY_DEFAULT:
      *out = cudaMemcpyDefault;
      return true;
  }
  return false;
}

cuferry_status cuferry_cuda_memcpy_async(void *dst, const void *src, size_t bytes,
                                    cuferry_copy_kind kind, cuferry_stream stream) {
  CF_REQUIRE(stream);
  cudaMemcpyKind cuda_kind;
  if (!cf_copy_kind(kind, &cuda_kind)) {
    return CUFERRY_STATUS_BAD_ENUM;
  }
  if (bytes == 0) {
    return CUFERRY_STATUS_SUCCESS;
  }
  CF_REQUIRE(dst);
  CF_REQUIRE(src);
  return cf_check(cudaMemcpyAsync(dst, src, bytes, cuda_kind, cf_stream(stream)));
}

cuferry_status cuferry_cuda_memcpy_peer_async(void *dst, int32_t dst_device, const void *src,
                                         int32_t src_device, size_t bytes,
                                         cuferry_stream stream) {
  CF_REQUIRE(stream);
  if (bytes == 0) {
    return CUFERRY_STATUS_SUCCESS;
  }
  CF_REQUIRE(dst);
  CF_REQUIRE(src);
  return cf_check(
      cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, cf_stream(stream)));
}

cuferry_status cuferry_cuda_memcpy_batch_async(void *const *dsts, const void *const *srcs,
                                          const size_t *sizes, size_t count,
                                          cuferry_stream stream) {
  CF_REQUIRE(stream);
  if (count == 0) {
    return CUFERRY_STATUS_SUCCESS;
  }
  CF_REQUIRE(dsts);
  CF_REQUIRE(srcs);
  CF_REQUIRE(sizes);
  // One attribute set for the whole batch: sources are read in stream order (cuferry orders
  // every earlier write to them on the stream before this call), no location hints (zeroed,
  // as they only apply to managed memory), no flags.
  cudaMemcpyAttributes attrs{};
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attrs.flags = cudaMemcpyFlagDefault;
  size_t first_copy = 0;
  return cf_check(cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attrs, &first_copy, 1,
                                       cf_stream(stream)));
}

cuferry_status cuferry_cuda_memset_async(void *dst, int32_t value, size_t bytes,
                                    cuferry_stream stream) {
  CF_REQUIRE(stream);
  if (bytes == 0) {
    return CUFERRY_STATUS_SUCCESS;
  }
  CF_REQUIRE(dst);
  // The stream's device current: CUDA promises copies on another device's stream, not memsets
  // (a thread that last worked on another GPU may zero this one's memory).
  CF_TRY(cf_use_stream_device(cf_stream(stream)));
  return cf_check(cudaMemsetAsync(dst, value, bytes, cf_stream(stream)));
}

}  // extern "C"
