/*
 * cuferry_absent.c: the C ABI of cuferry_cuda.h for builds without nvcc.
 *
 * Rule: every function reports CUFERRY_STATUS_NOT_BUILT and writes nothing; none reports
 * success. build.rs compiles this file (with the system C compiler) only when no nvcc was
 * found, so the Rust crate links and runs its host backend, and every CUDA path returns a
 * typed "not built with CUDA" error instead of failing to link.
 */
#include "cuferry_cuda.h"

#define NB return CUFERRY_STATUS_NOT_BUILT

const char *cuferry_cuda_status_name(cuferry_status status) {
  return status == CUFERRY_STATUS_NOT_BUILT ? "CUFERRY_STATUS_NOT_BUILT" : "CUFERRY_STATUS_UNKNOWN";
}
const char *cuferry_cuda_status_string(cuferry_status status) {
  return status == CUFERRY_STATUS_NOT_BUILT ? "cuferry was built without nvcc"
                                            : "unknown status (cuferry was built without nvcc)";
}
cuferry_status cuferry_cuda_take_last_error(void) { return CUFERRY_STATUS_SUCCESS; }
cuferry_status cuferry_cuda_runtime_version(int32_t *version) { (void)version; NB; }
cuferry_status cuferry_cuda_driver_version(int32_t *version) { (void)version; NB; }
cuferry_status cuferry_cuda_device_count(int32_t *count) { (void)count; NB; }
cuferry_status cuferry_cuda_device_properties(int32_t device, cuferry_device_props *props) {
  (void)device; (void)props; NB;
}
cuferry_status cuferry_cuda_device_mem_info(int32_t device, size_t *free_bytes, size_t *total_bytes) {
  (void)device; (void)free_bytes; (void)total_bytes; NB;
}
cuferry_status cuferry_cuda_device_synchronize(int32_t device) { (void)device; NB; }
cuferry_status cuferry_cuda_set_device(int32_t device) { (void)device; NB; }
cuferry_status cuferry_cuda_get_device(int32_t *device) { (void)device; NB; }
cuferry_status cuferry_cuda_thread_has_context(int32_t *has) { (void)has; NB; }
cuferry_status cuferry_cuda_active_device(int32_t *device) { (void)device; NB; }
cuferry_status cuferry_cuda_device_can_access_peer(int32_t device, int32_t peer, int32_t *can_access) {
  (void)device; (void)peer; (void)can_access; NB;
}
cuferry_status cuferry_cuda_device_enable_peer_access(int32_t device, int32_t peer) {
  (void)device; (void)peer; NB;
}
cuferry_status cuferry_cuda_device_get_l2_fetch_granularity(int32_t device, size_t *bytes) {
  (void)device; (void)bytes; NB;
}
cuferry_status cuferry_cuda_device_set_l2_fetch_granularity(int32_t device, size_t bytes) {
  (void)device; (void)bytes; NB;
}
cuferry_status cuferry_cuda_device_get_host_wait(int32_t device, uint32_t *schedule) {
  (void)device; (void)schedule; NB;
}
cuferry_status cuferry_cuda_device_set_host_wait(int32_t device, uint32_t schedule) {
  (void)device; (void)schedule; NB;
}
cuferry_status cuferry_cuda_stream_create(int32_t device, int32_t priority, cuferry_stream *stream) {
  (void)device; (void)priority; (void)stream; NB;
}
cuferry_status cuferry_cuda_stream_destroy(cuferry_stream stream) { (void)stream; NB; }
cuferry_status cuferry_cuda_stream_synchronize(cuferry_stream stream) { (void)stream; NB; }
cuferry_status cuferry_cuda_stream_query(cuferry_stream stream) { (void)stream; NB; }
cuferry_status cuferry_cuda_stream_wait_event(cuferry_stream stream, cuferry_event event) {
  (void)stream; (void)event; NB;
}
cuferry_status cuferry_cuda_stream_launch_host_fn(cuferry_stream stream, cuferry_host_fn fn,
                                             void *user_data) {
  (void)stream; (void)fn; (void)user_data; NB;
}
cuferry_status cuferry_cuda_event_create(int32_t device, int32_t timing, cuferry_event *event) {
  (void)device; (void)timing; (void)event; NB;
}
cuferry_status cuferry_cuda_event_destroy(cuferry_event event) { (void)event; NB; }
cuferry_status cuferry_cuda_event_record(cuferry_event event, cuferry_stream stream) {
  (void)event; (void)stream; NB;
}
cuferry_status cuferry_cuda_event_query(cuferry_event event) { (void)event; NB; }
cuferry_status cuferry_cuda_event_synchronize(cuferry_event event) { (void)event; NB; }
cuferry_status cuferry_cuda_event_elapsed_ms(cuferry_event start, cuferry_event end, float *ms) {
  (void)start; (void)end; (void)ms; NB;
}
cuferry_status cuferry_cuda_device_alloc(int32_t device, size_t bytes, void **ptr) {
  (void)device; (void)bytes; (void)ptr; NB;
}
cuferry_status cuferry_cuda_device_free(int32_t device, void *ptr) { (void)device; (void)ptr; NB; }
cuferry_status cuferry_cuda_pinned_alloc(int32_t device, size_t bytes, uint32_t flags, void **ptr) {
  (void)device; (void)bytes; (void)flags; (void)ptr; NB;
}
cuferry_status cuferry_cuda_pinned_free(int32_t device, void *ptr) { (void)device; (void)ptr; NB; }
cuferry_status cuferry_cuda_host_register(int32_t device, void *ptr, size_t bytes, uint32_t flags) {
  (void)device; (void)ptr; (void)bytes; (void)flags; NB;
}
cuferry_status cuferry_cuda_host_unregister(int32_t device, void *ptr) { (void)device; (void)ptr; NB; }
cuferry_status cuferry_cuda_pointer_type(const void *ptr, cuferry_pointer_type *type, int32_t *device) {
  (void)ptr; (void)type; (void)device; NB;
}
cuferry_status cuferry_cuda_memcpy_async(void *dst, const void *src, size_t bytes,
                                    cuferry_copy_kind kind, cuferry_stream stream) {
  (void)dst; (void)src; (void)bytes; (void)kind; (void)stream; NB;
}
cuferry_status cuferry_cuda_memcpy_peer_async(void *dst, int32_t dst_device, const void *src,
                                         int32_t src_device, size_t bytes,
                                         cuferry_stream stream) {
  (void)dst; (void)dst_device; (void)src; (void)src_device; (void)bytes; (void)stream; NB;
}
cuferry_status cuferry_cuda_memcpy_batch_async(void *const *dsts, const void *const *srcs,
                                          const size_t *sizes, size_t count,
                                          cuferry_stream stream) {
  (void)dsts; (void)srcs; (void)sizes; (void)count; (void)stream; NB;
}
cuferry_status cuferry_cuda_memset_async(void *dst, int32_t value, size_t bytes,
                                    cuferry_stream stream) {
  (void)dst; (void)value; (void)bytes; (void)stream; NB;
}

/* managed memory (managed.cu) */
cuferry_status cuferry_cuda_managed_pool_create(int32_t device, int32_t prefer_device, size_t max_size,
                                                uint64_t release_threshold, cuferry_mem_pool *pool) {
  (void)device; (void)prefer_device; (void)max_size; (void)release_threshold; (void)pool; NB;
}
cuferry_status cuferry_cuda_mem_pool_recycle(cuferry_mem_pool pool) { (void)pool; NB; }
cuferry_status cuferry_cuda_mem_pool_alloc_async(cuferry_mem_pool pool, size_t bytes,
                                                 cuferry_stream stream, void **ptr) {
  (void)pool; (void)bytes; (void)stream; (void)ptr; NB;
}
cuferry_status cuferry_cuda_free_async(void *ptr, cuferry_stream stream) { (void)ptr; (void)stream; NB; }
cuferry_status cuferry_cuda_mem_pool_stats(cuferry_mem_pool pool, cuferry_pool_stats *stats) {
  (void)pool; (void)stats; NB;
}
cuferry_status cuferry_cuda_malloc_managed(int32_t device, size_t bytes, void **ptr) {
  (void)device; (void)bytes; (void)ptr; NB;
}
cuferry_status cuferry_cuda_mem_prefetch_async(const void *ptr, size_t bytes, cuferry_location location,
                                               cuferry_stream stream) {
  (void)ptr; (void)bytes; (void)location; (void)stream; NB;
}
cuferry_status cuferry_cuda_mem_prefetch_batch_async(void **ptrs, size_t *sizes, size_t count,
                                                     cuferry_location *locations,
                                                     size_t *location_starts, size_t n_locations,
                                                     cuferry_stream stream) {
  (void)ptrs; (void)sizes; (void)count; (void)locations; (void)location_starts; (void)n_locations;
  (void)stream; NB;
}
cuferry_status cuferry_cuda_mem_discard_batch_async(void **ptrs, size_t *sizes, size_t count,
                                                    cuferry_stream stream) {
  (void)ptrs; (void)sizes; (void)count; (void)stream; NB;
}
cuferry_status cuferry_cuda_mem_discard_and_prefetch_batch_async(void **ptrs, size_t *sizes, size_t count,
                                                                 cuferry_location *locations,
                                                                 size_t *location_starts,
                                                                 size_t n_locations,
                                                                 cuferry_stream stream) {
  (void)ptrs; (void)sizes; (void)count; (void)locations; (void)location_starts; (void)n_locations;
  (void)stream; NB;
}
cuferry_status cuferry_cuda_mem_advise_ranges(void **ptrs, size_t *sizes, size_t count, int32_t advice,
                                              cuferry_location location) {
  (void)ptrs; (void)sizes; (void)count; (void)advice; (void)location; NB;
}
cuferry_status cuferry_cuda_fill_pattern_u32(uint32_t *data, size_t n, uint32_t seed,
                                             cuferry_stream stream) {
  (void)data; (void)n; (void)seed; (void)stream; NB;
}
cuferry_status cuferry_cuda_sum_u32(const uint32_t *data, size_t n, unsigned long long *sum,
                                    cuferry_stream stream) {
  (void)data; (void)n; (void)sum; (void)stream; NB;
}

/* ---- halo pack/unpack ----------------------------------------------------------------------- */
cuferry_status cuferry_cuda_halo_launch(int32_t device, const cuferry_halo_desc *table, int32_t n_desc,
                                   int64_t total_units, void *packed, int32_t direction,
                                   cuferry_stream stream) {
  (void)device; (void)table; (void)n_desc; (void)total_units; (void)packed; (void)direction;
  (void)stream; NB;
}
cuferry_status cuferry_cuda_halo_launch_inline(int32_t device, const cuferry_halo_desc *table,
                                               int32_t n_desc, int64_t total_units, void *packed,
                                               int32_t direction, cuferry_stream stream) {
  (void)device; (void)table; (void)n_desc; (void)total_units; (void)packed; (void)direction;
  (void)stream; NB;
}
cuferry_status cuferry_cuda_halo_emulate(const cuferry_halo_desc *table, int32_t n_desc,
                                         int64_t total_units, void *packed, int32_t direction,
                                         int32_t in_flight, int32_t max_blocks) {
  (void)table; (void)n_desc; (void)total_units; (void)packed; (void)direction; (void)in_flight;
  (void)max_blocks; NB;
}
cuferry_status cuferry_cuda_halo_seed_pack_launch(int32_t device, const void *src,
                                             const int32_t *indices, int64_t n, void *dst,
                                             int32_t elem_size, int32_t elem_kind, int32_t negate,
                                             cuferry_stream stream) {
  (void)device; (void)src; (void)indices; (void)n; (void)dst; (void)elem_size; (void)elem_kind;
  (void)negate; (void)stream; NB;
}

/* linop kernels */
cuferry_status cuferry_cuda_linop_map(int32_t dtype, const cuferry_linop_map *map, const void *src, void *dst,
                                      double alpha_re, double alpha_im, cuferry_stream stream) {
  (void)dtype; (void)map; (void)src; (void)dst; (void)alpha_re; (void)alpha_im; (void)stream; NB;
}
cuferry_status cuferry_cuda_linop_contract(int32_t dtype, const cuferry_linop_contraction *c, const void *x,
                                           const void *w, void *out, cuferry_stream stream) {
  (void)dtype; (void)c; (void)x; (void)w; (void)out; (void)stream; NB;
}
