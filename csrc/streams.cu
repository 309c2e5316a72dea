// streams.cu: streams, events and host callbacks.
//
// Rules: streams are created non-blocking (no implicit sync with the legacy default stream);
// destroying a stream or event with work pending is legal and the work still completes.
#include <new>

#include "common.cuh"

namespace {

// What cf_host_callback needs: the caller's function and its data.
struct cf_host_call {
  cuferry_host_fn fn;
  void *user_data;
};

// cudaStreamAddCallback's callback: CUDA calls it exactly once per successful add.
void CUDART_CB cf_host_callback(cudaStream_t, cudaError_t status, void *call_ptr) {
  cf_host_call call = *static_cast<cf_host_call *>(call_ptr);
  delete static_cast<cf_host_call *>(call_ptr);
  call.fn(static_cast<cuferry_status>(status), call.user_data);
}

}  // namespace

extern "C" {

cuferry_status cuferry_cuda_stream_create(int32_t device, int32_t priority, cuferry_stream *stream) {
  CF_REQUIRE(stream);
  CF_TRY(cudaSetDevice(device));
  cudaStream_t s = nullptr;
  CF_TRY(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  *stream = reinterpret_cast<cuferry_stream>(s);
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_stream_destroy(cuferry_stream stream) {
  CF_REQUIRE(stream);
  return cf_check(cudaStreamDestroy(cf_stream(stream)));
}

cuferry_status cuferry_cuda_stream_synchronize(cuferry_stream stream) {
  CF_REQUIRE(stream);
  return cf_check(cudaStreamSynchronize(cf_stream(stream)));
}

cuferry_status cuferry_cuda_stream_query(cuferry_stream stream) {
  CF_REQUIRE(stream);
  return cf_check(cudaStreamQuery(cf_stream(stream)));
}

cuferry_status cuferry_cuda_stream_wait_event(cuferry_stream stream, cuferry_event event) {
  CF_REQUIRE(stream);
  CF_REQUIRE(event);
  return cf_check(cudaStreamWaitEvent(cf_stream(stream), cf_event(event), 0));
}

cuferry_status cuferry_cuda_stream_launch_host_fn(cuferry_stream stream, cuferry_host_fn fn,
                                             void *user_data) {
  CF_REQUIRE(stream);
  CF_REQUIRE(fn);
  cf_host_call *call = new (std::nothrow) cf_host_call{fn, user_data};
  if (call == nullptr) return cf_check(cudaErrorMemoryAllocation);
  cuferry_status status = cf_check(cudaStreamAddCallback(cf_stream(stream), cf_host_callback, call, 0));
  if (status != CUFERRY_STATUS_SUCCESS) delete call;  // CUDA will not call it
  return status;
}

cuferry_status cuferry_cuda_event_create(int32_t device, int32_t timing, cuferry_event *event) {
  CF_REQUIRE(event);
  CF_TRY(cudaSetDevice(device));
  cudaEvent_t e = nullptr;
  unsigned flags = timing ? cudaEventDefault : cudaEventDisableTiming;
  // cudaEventSynchronize busy-waits unless the event was made with cudaEventBlockingSync,
  // whatever the device's scheduling flag: an event made while the device is set to block
  // (Device::set_host_wait(Block)) blocks its waiters as cudaStreamSynchronize does.
  unsigned device_flags = 0;
  CF_TRY(cudaGetDeviceFlags(&device_flags));
  if ((device_flags & cudaDeviceScheduleMask) == cudaDeviceScheduleBlockingSync) flags |= cudaEventBlockingSync;
  CF_TRY(cudaEventCreateWithFlags(&e, flags));
  *event = reinterpret_cast<cuferry_event>(e);
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_event_destroy(cuferry_event event) {
  CF_REQUIRE(event);
  return cf_check(cudaEventDestroy(cf_event(event)));
}

cuferry_status cuferry_cuda_event_record(cuferry_event event, cuferry_stream stream) {
  CF_REQUIRE(event);
  CF_REQUIRE(stream);
  return cf_check(cudaEventRecord(cf_event(event), cf_stream(stream)));
}

cuferry_status cuferry_cuda_event_query(cuferry_event event) {
  CF_REQUIRE(event);
  return cf_check(cudaEventQuery(cf_event(event)));
}

cuferry_status cuferry_cuda_event_synchronize(cuferry_event event) {
  CF_REQUIRE(event);
  return cf_check(cudaEventSynchronize(cf_event(event)));
}

cuferry_status cuferry_cuda_event_elapsed_ms(cuferry_event start, cuferry_event end, float *ms) {
  CF_REQUIRE(start);
  CF_REQUIRE(end);
  CF_REQUIRE(ms);
  float v = 0.0f;
  CF_TRY(cudaEventElapsedTime(&v, cf_event(start), cf_event(end)));
  *ms = v;
  return CUFERRY_STATUS_SUCCESS;
}

}  // extern "C"
