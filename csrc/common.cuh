// common.cuh: helpers shared by the csrc/*.cu files (internal, not part of the C ABI).
//
// Rules: every CUDA call's result goes through cf_check(), which clears the thread's last
// error when a failure set it (rule 3 of cuferry_cuda.h); CF_TRY returns the first failure.
// Kernels are launched with cf_launch, never <<<>>>: a launch reports its own status.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuferry_cuda.h"

// Converts a CUDA result to a cuferry_status, clearing the thread's last error when it failed
// and the last error is this failure. A call that failed without setting the last error (a
// query answering cudaErrorNotReady may not set it) leaves another library's pending error
// where it was, instead of taking it away unseen; a failure that set it overwrote any earlier
// one, as CUDA defines, and is cleared.
static inline cuferry_status cf_check(cudaError_t err) {
  if (err != cudaSuccess && cudaPeekAtLastError() == err) {
    (void)cudaGetLastError();
  }
  return static_cast<cuferry_status>(err);
}

// Evaluates a CUDA call and returns its status from the enclosing function when it failed.
#define CF_TRY(call)                                \
  do {                                              \
    cuferry_status cf_status_ = cf_check((call));   \
    if (cf_status_ != CUFERRY_STATUS_SUCCESS) {     \
      return cf_status_;                            \
    }                                               \
  } while (0)

// Returns CUFERRY_STATUS_NULL_ARGUMENT from the enclosing function when `ptr` is NULL.
#define CF_REQUIRE(ptr)                             \
  do {                                              \
    if ((ptr) == nullptr) {                         \
      return CUFERRY_STATUS_NULL_ARGUMENT;          \
    }                                               \
  } while (0)

// Queues kernel<<<grid, block, 0, stream>>>(args...) through cudaLaunchKernelEx and returns
// that launch's own status. A <<<>>> launch returns nothing, and reading its status with
// cudaGetLastError would take (and clear) a failure another library left in the thread's last
// error and report it as this launch's. The arguments convert to the kernel's parameter types
// as in a call (the runtime's type-checked overload).
template <typename... Params, typename... Args>
static inline cuferry_status cf_launch(void (*kernel)(Params...), unsigned grid, unsigned block,
                                       cudaStream_t stream, Args &&...args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = nullptr;
  config.numAttrs = 0;
  return cf_check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

static inline cudaStream_t cf_stream(cuferry_stream s) { return reinterpret_cast<cudaStream_t>(s); }
static inline cudaEvent_t cf_event(cuferry_event e) { return reinterpret_cast<cudaEvent_t>(e); }

// Makes `s`'s device current before a kernel launch: a launch into a stream of a device other
// than the current one fails, and other calls (event creation, allocation) move the current
// device. Left current afterwards, as rule 4 of cuferry_cuda.h does for creation calls.
static inline cudaError_t cf_use_stream_device(cudaStream_t s) {
  int device = 0;
  const cudaError_t err = cudaStreamGetDevice(s, &device);
  return err != cudaSuccess ? err : cudaSetDevice(device);
}

