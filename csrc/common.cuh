// common.cuh: helpers shared by the csrc/*.cu files (internal, not part of the C ABI).
//
// Rules: every CUDA call's result goes through cf_check(), which clears the thread's last
// error on failure (rule 3 of cuferry_cuda.h); CF_TRY returns the first failure.
#pragma once

#include <cuda_runtime.h>

#include "cuferry_cuda.h"

// Converts a CUDA result to a cuferry_status, clearing the thread's last error when it failed.
static inline cuferry_status cf_check(cudaError_t err) {
  if (err != cudaSuccess) {
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

