/* A C program that uses cuferry only through include/cuferry.h (built and run by
 * tests/c_abi.rs). Usage: consumer DEVICE, with DEVICE -1 for the host backend or a CUDA
 * ordinal. Exits 0 when every check passes; prints the first failed check otherwise. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuferry.h"

static int failures = 0;

#define CHECK(cond)                                                                      \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      fprintf(stderr, "FAILED %s:%d: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              cuferry_last_error_message());                                             \
      failures++;                                                                        \
    }                                                                                    \
  } while (0)

#define OK(call) CHECK((call) == CUFERRY_STATUS_OK)

int main(int argc, char **argv) {
  int32_t device = argc > 1 ? (int32_t)atoi(argv[1]) : CUFERRY_HOST;
  printf("cuferry %s, device %d\n", cuferry_version(), (int)device);

  int32_t count = -7;
  CuferryStatus st = cuferry_device_count(&count);
  CHECK(count >= 0);
  CHECK(st == CUFERRY_STATUS_OK || count == 0);
  CHECK(strcmp(cuferry_status_name(CUFERRY_STATUS_INVALID_ARGUMENT), "CUFERRY_STATUS_INVALID_ARGUMENT") == 0);
  CHECK(strcmp(cuferry_status_name(1234), "CUFERRY_STATUS_UNKNOWN") == 0);

  /* Round trip: pinned -> device -> device -> pinned, every byte checked. */
  const size_t n = (3u << 20) + 17;
  CuferryStream *stream = NULL;
  OK(cuferry_stream_create(device, &stream));
  CuferryBuffer *src = NULL, *dev1 = NULL, *dev2 = NULL, *back = NULL;
  OK(cuferry_pinned_alloc(device, n, &src));
  OK(cuferry_device_alloc(stream, n, &dev1));
  OK(cuferry_device_alloc(stream, n, &dev2));
  OK(cuferry_pinned_alloc(device, n, &back));
  if (failures) return 1;
  CHECK(cuferry_buffer_size(src) == n);
  unsigned char *s = (unsigned char *)cuferry_buffer_ptr(src);
  OK(cuferry_buffer_synchronize(src));
  for (size_t i = 0; i < n; i++) s[i] = (unsigned char)(i * 31u + 7u);
  OK(cuferry_copy(stream, src, 0, dev1, 0, n));
  OK(cuferry_copy(stream, dev1, 0, dev2, 0, n));
  OK(cuferry_copy(stream, dev2, 0, back, 0, n));
  OK(cuferry_buffer_synchronize(back));
  const unsigned char *b = (const unsigned char *)cuferry_buffer_ptr(back);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += b[i] != (unsigned char)(i * 31u + 7u);
  CHECK(bad == 0);

  /* A sub-range copy lands where asked. */
  OK(cuferry_copy(stream, src, 100, back, 0, 10));
  OK(cuferry_buffer_synchronize(back));
  CHECK(b[0] == s[100] && b[9] == s[109]);

  /* Bad arguments are errors with a message, never crashes. */
  CHECK(cuferry_copy(stream, src, n - 5, back, 0, 10) == CUFERRY_STATUS_INVALID_ARGUMENT);
  CHECK(strlen(cuferry_last_error_message()) > 0);
  CHECK(cuferry_last_error_status() == CUFERRY_STATUS_INVALID_ARGUMENT);
  /* Within one buffer: overlapping ranges are refused, disjoint ones copy. */
  CHECK(cuferry_copy(stream, src, 0, (CuferryBuffer *)src, 0, 1) == CUFERRY_STATUS_INVALID_ARGUMENT);
  CHECK(cuferry_copy(stream, src, 0, (CuferryBuffer *)src, 5, 10) == CUFERRY_STATUS_INVALID_ARGUMENT);
  OK(cuferry_copy(stream, back, 0, back, 20, 10));
  OK(cuferry_buffer_synchronize(back));
  CHECK(b[20] == s[100] && b[29] == s[109]);

  /* A batch: eight 4 KiB pieces of src, scattered in reverse order into dev1 in one call,
   * then read back. A batch writing a byte twice is refused and writes nothing. */
  {
    CuferryCopyRange ranges[8];
    for (size_t k = 0; k < 8; k++) {
      ranges[k].src_offset = 4096 * k + 3;
      ranges[k].dst_offset = 4096 * (7 - k);
      ranges[k].bytes = 4096;
    }
    OK(cuferry_copy_batch(stream, src, dev1, ranges, 8));
    OK(cuferry_copy(stream, dev1, 0, back, 0, 8 * 4096));
    OK(cuferry_buffer_synchronize(back));
    size_t wrong = 0;
    for (size_t k = 0; k < 8; k++)
      for (size_t i = 0; i < 4096; i++) wrong += b[4096 * (7 - k) + i] != s[4096 * k + 3 + i];
    CHECK(wrong == 0);
    ranges[1].dst_offset = ranges[0].dst_offset + 1;
    ranges[1].src_offset = 0;
    CHECK(cuferry_copy_batch(stream, src, dev1, ranges, 8) == CUFERRY_STATUS_INVALID_ARGUMENT);
    CHECK(cuferry_copy_batch(stream, src, dev1, NULL, 1) == CUFERRY_STATUS_INVALID_ARGUMENT);
    OK(cuferry_copy_batch(stream, src, dev1, NULL, 0));
    OK(cuferry_copy(stream, dev1, 0, back, 0, 8 * 4096));
    OK(cuferry_buffer_synchronize(back));
    wrong = 0;
    for (size_t k = 0; k < 8; k++)
      for (size_t i = 0; i < 4096; i++) wrong += b[4096 * (7 - k) + i] != s[4096 * k + 3 + i];
    CHECK(wrong == 0);
  }
  /* The program's own malloc'd memory, wrapped: a read-only table gathered into dev2 by a
   * batch, then copied out into a wrapped result; a copy into the read-only wrapper is
   * refused. Freeing a wrapper waits for its copies and leaves the memory to the program. */
  {
    const size_t items = 16, item = 1000;
    unsigned char *table = (unsigned char *)malloc(items * item);
    unsigned char *result = (unsigned char *)calloc(items, item);
    CHECK(table != NULL && result != NULL);
    if (table == NULL || result == NULL) return 1;
    for (size_t i = 0; i < items * item; i++) table[i] = (unsigned char)(i * 13u + 5u);
    CuferryBuffer *from = NULL, *to = NULL;
    OK(cuferry_buffer_wrap(device, table, items * item, CUFERRY_WRAP_READ_ONLY, &from));
    OK(cuferry_buffer_wrap(device, result, items * item, 0, &to));
    CHECK(cuferry_buffer_ptr(to) == result && cuferry_buffer_size(from) == items * item);
    CuferryCopyRange gather[16];
    for (size_t k = 0; k < items; k++) {
      gather[k].src_offset = item * ((k * 7) % items); /* a permutation of the items */
      gather[k].dst_offset = item * k;
      gather[k].bytes = item;
    }
    OK(cuferry_copy_batch(stream, from, dev2, gather, items));
    OK(cuferry_copy(stream, dev2, 0, to, 0, items * item));
    CHECK(cuferry_copy(stream, to, 0, from, 0, 1) == CUFERRY_STATUS_INVALID_ARGUMENT);
    OK(cuferry_buffer_free(from));
    OK(cuferry_buffer_free(to));
    size_t wrong = 0;
    for (size_t k = 0; k < items; k++)
      for (size_t i = 0; i < item; i++) wrong += result[item * k + i] != table[item * ((k * 7) % items) + i];
    CHECK(wrong == 0);
    CHECK(table[0] == 5u);
    CHECK(cuferry_buffer_wrap(device, NULL, 8, 0, &from) == CUFERRY_STATUS_INVALID_ARGUMENT);
    CHECK(cuferry_buffer_wrap(device, table, 8, 8, &from) == CUFERRY_STATUS_INVALID_ARGUMENT);
    free(table);
    free(result);
  }
  CHECK(cuferry_copy(NULL, src, 0, back, 0, 1) == CUFERRY_STATUS_INVALID_ARGUMENT);
  CHECK(cuferry_copy(stream, NULL, 0, back, 0, 1) == CUFERRY_STATUS_INVALID_ARGUMENT);
  CHECK(cuferry_stream_create(device, NULL) == CUFERRY_STATUS_INVALID_ARGUMENT);
  CHECK(cuferry_stream_create(-5, &stream) == CUFERRY_STATUS_INVALID_ARGUMENT);
  CHECK(cuferry_pinned_alloc(device, 16, NULL) == CUFERRY_STATUS_INVALID_ARGUMENT);
  CHECK(cuferry_buffer_ptr(NULL) == NULL && cuferry_buffer_size(NULL) == 0);
  CHECK(cuferry_buffer_synchronize(NULL) == CUFERRY_STATUS_INVALID_ARGUMENT);

  /* The stream's cudaStream_t: a handle on CUDA, none (UNSUPPORTED, NULL) on the host. */
  void *raw = (void *)&raw;
  if (device == CUFERRY_HOST) {
    CHECK(cuferry_stream_cuda_handle(stream, &raw) == CUFERRY_STATUS_UNSUPPORTED && raw == NULL);
  } else {
    OK(cuferry_stream_cuda_handle(stream, &raw));
    CHECK(raw != NULL);
  }
  raw = (void *)&raw; /* a refused call leaves the out-parameter alone */
  CHECK(cuferry_stream_cuda_handle(NULL, &raw) == CUFERRY_STATUS_INVALID_ARGUMENT && raw == (void *)&raw);
  CHECK(cuferry_stream_cuda_handle(stream, NULL) == CUFERRY_STATUS_INVALID_ARGUMENT);

  /* Without a usable CUDA device, CUDA requests fail with a typed status. */
  if (count == 0) {
    CuferryStream *cuda = NULL;
    CuferryStatus s0 = cuferry_stream_create(0, &cuda);
    CHECK(s0 == CUFERRY_STATUS_NO_DRIVER || s0 == CUFERRY_STATUS_NO_DEVICE || s0 == CUFERRY_STATUS_UNSUPPORTED);
    CHECK(cuda == NULL);
  } else {
    /* An ordinal past the devices present is a bad argument, not a CUDA failure. */
    CuferryStream *past = (CuferryStream *)&raw;
    CHECK(cuferry_stream_create(count + 3, &past) == CUFERRY_STATUS_INVALID_ARGUMENT);
    CHECK(past == (CuferryStream *)&raw);
    CuferryBuffer *pinned_past = NULL;
    CHECK(cuferry_pinned_alloc(count + 3, 16, &pinned_past) == CUFERRY_STATUS_INVALID_ARGUMENT);
    CHECK(pinned_past == NULL);
  }

  /* The device's managed pool made before its first use, with the options first use would
   * take (flags 0, no limit): the same options again succeed; other options, once it exists,
   * are refused naming it (on the host the flags are ignored: there a size limit differs). */
  OK(cuferry_managed_pool_configure(device, 0, 0));
  OK(cuferry_managed_pool_configure(device, 0, 0));
  if (device == CUFERRY_HOST) {
    OK(cuferry_managed_pool_configure(device, CUFERRY_MANAGED_POOL_MALLOC_MANAGED, 0));
    CHECK(cuferry_managed_pool_configure(device, 0, 1u << 20) == CUFERRY_STATUS_INVALID_ARGUMENT);
  } else {
    CHECK(cuferry_managed_pool_configure(device, CUFERRY_MANAGED_POOL_MALLOC_MANAGED, 0) ==
          CUFERRY_STATUS_INVALID_ARGUMENT);
  }
  CHECK(strstr(cuferry_last_error_message(), "already exists") != NULL);
  CHECK(cuferry_managed_pool_configure(device, 1u << 7, 0) == CUFERRY_STATUS_INVALID_ARGUMENT);
  CHECK(cuferry_managed_pool_configure(-2, 0, 0) == CUFERRY_STATUS_INVALID_ARGUMENT);

  /* Managed memory through the PyTorch allocator pair (stream NULL: the legacy default). */
  const size_t m_bytes = 1u << 20;
  void *m = cuferry_managed_malloc((ssize_t)m_bytes, device, NULL);
  CHECK(m != NULL);
  if (m != NULL) {
    CuferryLocation host = {CUFERRY_LOCATION_HOST, 0};
    CuferryLocation here = {device < 0 ? CUFERRY_LOCATION_HOST : CUFERRY_LOCATION_DEVICE, device < 0 ? 0 : device};
    OK(cuferry_managed_prefetch(m, m_bytes, here, NULL));
    const void *ptrs[3] = {m, (const char *)m + 4096, (const char *)m + 8192};
    size_t sizes[3] = {4096, 4096, m_bytes - 8192};
    OK(cuferry_managed_prefetch_batch(ptrs, sizes, 3, host, NULL));
    /* Advice is taken, or refused as UNSUPPORTED only on the memory of a CUDA managed memory
     * pool (pool kind 1), whose driver may refuse advice (the H100's driver 580.159 does). */
    int32_t pool_kind = -1;
    OK(cuferry_managed_pool_kind(device, &pool_kind));
    const int32_t advice[3] = {CUFERRY_ADVISE_SET_READ_MOSTLY, CUFERRY_ADVISE_UNSET_READ_MOSTLY,
                               CUFERRY_ADVISE_SET_PREFERRED_LOCATION};
    for (int k = 0; k < 3; ++k) {
      CuferryStatus s = cuferry_managed_advise(m, m_bytes, advice[k], k == 2 ? here : host);
      CHECK(s == CUFERRY_STATUS_OK ||
            (pool_kind == 1 && s == CUFERRY_STATUS_UNSUPPORTED &&
             strstr(cuferry_last_error_message(), "managed memory pool") != NULL));
    }
    /* A range past the allocation, a foreign pointer, bad advice and bad locations fail. */
    CHECK(cuferry_managed_prefetch(m, m_bytes + 1, host, NULL) == CUFERRY_STATUS_INVALID_ARGUMENT);
    int local = 0;
    CHECK(cuferry_managed_prefetch(&local, sizeof local, host, NULL) == CUFERRY_STATUS_INVALID_ARGUMENT);
    CHECK(cuferry_managed_advise(m, m_bytes, 42, host) == CUFERRY_STATUS_INVALID_ARGUMENT);
    CuferryLocation nowhere = {77, 0};
    CHECK(cuferry_managed_prefetch(m, m_bytes, nowhere, NULL) == CUFERRY_STATUS_INVALID_ARGUMENT);
    CuferryPoolStats ps;
    OK(cuferry_managed_pool_stats(device, &ps));
    if (device < 0) CHECK(ps.used_current >= m_bytes && ps.used_high >= ps.used_current);
    int32_t kind = -1;
    OK(cuferry_managed_pool_kind(device, &kind));
    CHECK(device < 0 ? kind == 0 : (kind == 1 || kind == 2));
    cuferry_managed_free(m, (ssize_t)m_bytes, device, NULL);
    /* A double free is reported, not acted on. */
    cuferry_managed_free(m, (ssize_t)m_bytes, device, NULL);
    CHECK(strstr(cuferry_last_error_message(), "double free") != NULL);
  }
  CHECK(cuferry_managed_malloc(0, device, NULL) == NULL);
  CHECK(cuferry_managed_malloc(-5, device, NULL) == NULL);
  CHECK(strlen(cuferry_last_error_message()) > 0);

  /* A halo: a 6 x 6 array of doubles (y, x) with a halo of 1; its east interior column is
   * packed and unpacked (loopback) into its west halo column. */
  {
    enum { W = 6 };
    CuferryHaloExchange ex;
    memset(&ex, 0, sizeof ex);
    ex.element_size = sizeof(double);
    ex.ndim = 2;
    ex.shape[0] = W;
    ex.shape[1] = W;
    ex.y_dim = 0;
    ex.x_dim = 1;
    ex.pack_start[0] = 1; ex.pack_end[0] = W - 1; ex.pack_start[1] = W - 2; ex.pack_end[1] = W - 1;
    ex.unpack_start[0] = 1; ex.unpack_end[0] = W - 1; ex.unpack_start[1] = 0; ex.unpack_end[1] = 1;
    CuferryHaloPacker *packer = NULL;
    OK(cuferry_halo_packer_create(device, &ex, 1, &packer));
    CuferryBuffer *host_grid = NULL, *grid = NULL;
    OK(cuferry_pinned_alloc(device, W * W * sizeof(double), &host_grid));
    OK(cuferry_device_alloc(stream, W * W * sizeof(double), &grid));
    if (packer && host_grid && grid) {
      double *h = (double *)cuferry_buffer_ptr(host_grid);
      OK(cuferry_buffer_synchronize(host_grid));
      for (int i = 0; i < W * W; i++) h[i] = 100.0 + i;
      OK(cuferry_copy(stream, host_grid, 0, grid, 0, W * W * sizeof(double)));
      const CuferryBuffer *arrays[1] = {grid};
      OK(cuferry_halo_pack(packer, arrays, 1));
      void *packed = NULL;
      size_t packed_bytes = 0;
      OK(cuferry_halo_pack_buffer(packer, &packed, &packed_bytes));
      CHECK(packed != NULL && packed_bytes == (W - 2) * sizeof(double));
      OK(cuferry_halo_loopback(packer));
      OK(cuferry_halo_unpack(packer, arrays, 1));
      OK(cuferry_halo_synchronize(packer));
      OK(cuferry_copy(stream, grid, 0, host_grid, 0, W * W * sizeof(double)));
      OK(cuferry_buffer_synchronize(host_grid));
      for (int y = 1; y < W - 1; y++) CHECK(h[y * W + 0] == 100.0 + y * W + (W - 2));
      CHECK(h[0] == 100.0 && h[(W - 1) * W] == 100.0 + (W - 1) * W); /* halo corners untouched */
      /* Host memory is the host packer's to reach, not a CUDA kernel's. Bad arguments: a
       * wrong count, a bad description. */
      const CuferryBuffer *pinned_arrays[1] = {host_grid};
      if (device == CUFERRY_HOST)
        OK(cuferry_halo_pack(packer, pinned_arrays, 1));
      else
        CHECK(cuferry_halo_pack(packer, pinned_arrays, 1) == CUFERRY_STATUS_INVALID_ARGUMENT);
      CHECK(cuferry_halo_pack(packer, arrays, 0) == CUFERRY_STATUS_INVALID_ARGUMENT);
      CuferryHaloExchange bad = ex;
      bad.pack_end[1] = W + 3;
      CuferryHaloPacker *none = NULL;
      CHECK(cuferry_halo_packer_create(device, &bad, 1, &none) == CUFERRY_STATUS_INVALID_ARGUMENT && none == NULL);
    }
    OK(cuferry_halo_packer_destroy(packer));
    OK(cuferry_buffer_free(host_grid));
    OK(cuferry_buffer_free(grid));
  }

  /* The slot ring: publish by hand, abandon, the pipelined produce, FIFO order, timeouts,
   * backpressure, bad arguments, close. Bytes are checked on the host backend, where an
   * item's memory is host memory; on CUDA only the protocol (Python checks bytes there). */
  {
    const size_t slot_bytes = 4096;
    CuferryRing *ring = NULL;
    OK(cuferry_ring_create(device, 4, slot_bytes, 2, &ring));
    CuferryRing *no_ring = NULL;
    CHECK(cuferry_ring_create(device, 0, slot_bytes, 2, &no_ring) == CUFERRY_STATUS_INVALID_ARGUMENT && no_ring == NULL);
    CuferryRingSlot *slot = NULL;
    void *host = NULL;
    OK(cuferry_ring_acquire(ring, 0, &slot, &host));
    CHECK(slot != NULL && host != NULL);
    for (int i = 0; i < 100; i++) ((unsigned char *)host)[i] = (unsigned char)(i * 7 + 1);
    OK(cuferry_ring_publish(slot, 1, 100));
    OK(cuferry_ring_acquire(ring, -1, &slot, &host));
    OK(cuferry_ring_abandon(slot)); /* never handed out */
    static unsigned char sources[3][3000];
    const void *source_ptrs[3];
    uint64_t sequences[3];
    size_t lengths[3];
    for (int k = 0; k < 3; k++) {
      for (int i = 0; i < 3000; i++) sources[k][i] = (unsigned char)(i * (k + 3) + k);
      source_ptrs[k] = sources[k];
      sequences[k] = 10 + (uint64_t)k;
      lengths[k] = 1000 * (size_t)(k + 1);
    }
    OK(cuferry_ring_produce(ring, sequences, source_ptrs, lengths, 3, 2));
    CuferryRingStats stats;
    OK(cuferry_ring_stats(ring, &stats));
    CHECK(stats.published == 4 && stats.occupancy == 4 && stats.bytes == 100 + 1000 + 2000 + 3000);
    /* Full: no slot for a producer until a consumer releases one. */
    CHECK(cuferry_ring_acquire(ring, 0, &slot, &host) == CUFERRY_STATUS_WOULD_BLOCK);
    CHECK(cuferry_ring_acquire(ring, 2000, &slot, &host) == CUFERRY_STATUS_TIMEOUT);
    const uint64_t want_seq[4] = {1, 10, 11, 12};
    const size_t want_bytes[4] = {100, 1000, 2000, 3000};
    for (int k = 0; k < 4; k++) {
      CuferryRingItem *item = NULL;
      OK(cuferry_ring_next(ring, stream, -1, &item));
      void *dptr = NULL;
      uint64_t seq = 0;
      size_t bytes = 0;
      OK(cuferry_ring_item_info(item, &dptr, &seq, &bytes));
      CHECK(dptr != NULL && seq == want_seq[k] && bytes == want_bytes[k]);
      if (device == CUFERRY_HOST) {
        OK(cuferry_stream_synchronize(stream));
        const unsigned char *got = dptr;
        int same = 1;
        for (size_t i = 0; i < bytes; i++) {
          unsigned char want = k == 0 ? (unsigned char)(i * 7 + 1) : sources[k - 1][i];
          same &= got[i] == want;
        }
        CHECK(same);
      }
      OK(cuferry_ring_release(item));
    }
    CuferryRingItem *item = NULL;
    CHECK(cuferry_ring_next(ring, stream, 0, &item) == CUFERRY_STATUS_WOULD_BLOCK && item == NULL);
    CHECK(cuferry_ring_next(ring, stream, 2000, &item) == CUFERRY_STATUS_TIMEOUT);
    OK(cuferry_ring_stats(ring, &stats));
    CHECK(stats.occupancy == 0 && stats.high_water == 4);
    /* produce_timeout: with no consumer, the 4 slots take 4 of 6 items; a timeout of 0 ends
     * the call with WOULD_BLOCK, a positive one with TIMEOUT; *published counts the call's own
     * items (a prefix), so the producer resumes from there once the consumer drains. */
    {
      static unsigned char many[6][64];
      const void *many_ptrs[6];
      uint64_t many_seqs[6];
      size_t many_lens[6];
      for (int k = 0; k < 6; k++) {
        for (int i = 0; i < 64; i++) many[k][i] = (unsigned char)(40 + k * 3 + i);
        many_ptrs[k] = many[k];
        many_seqs[k] = 20 + (uint64_t)k;
        many_lens[k] = 64;
      }
      uint64_t published = 99;
      CHECK(cuferry_ring_produce_timeout(ring, many_seqs, many_ptrs, many_lens, 6, 2, 0, &published) ==
                CUFERRY_STATUS_WOULD_BLOCK &&
            published == 4);
      CHECK(cuferry_ring_produce_timeout(ring, many_seqs + 4, many_ptrs + 4, many_lens + 4, 2, 2, 1000, &published) ==
                CUFERRY_STATUS_TIMEOUT &&
            published == 0);
      for (int k = 0; k < 6; k++) {
        if (k == 4) {
          OK(cuferry_ring_produce_timeout(ring, many_seqs + 4, many_ptrs + 4, many_lens + 4, 2, 2, -1, &published));
          CHECK(published == 2);
        }
        CuferryRingItem *got_item = NULL;
        OK(cuferry_ring_next(ring, stream, -1, &got_item));
        void *dptr = NULL;
        uint64_t seq = 0;
        size_t bytes = 0;
        OK(cuferry_ring_item_info(got_item, &dptr, &seq, &bytes));
        CHECK(seq == many_seqs[k] && bytes == 64);
        if (device == CUFERRY_HOST) {
          OK(cuferry_stream_synchronize(stream));
          CHECK(memcmp(dptr, many[k], 64) == 0);
        }
        OK(cuferry_ring_release(got_item));
      }
      OK(cuferry_ring_produce_timeout(ring, many_seqs, many_ptrs, many_lens, 0, 1, -1, NULL)); /* nothing to do */
      published = 99;
      CHECK(cuferry_ring_produce_timeout(NULL, many_seqs, many_ptrs, many_lens, 1, 1, -1, &published) ==
                CUFERRY_STATUS_INVALID_ARGUMENT &&
            published == 0);
      OK(cuferry_ring_stats(ring, &stats));
      CHECK(stats.occupancy == 0 && stats.published == 10);
    }
    /* Bad arguments: NULL handles, too many bytes (the slot goes back), an overflowing item. */
    CHECK(cuferry_ring_publish(NULL, 0, 1) == CUFERRY_STATUS_INVALID_ARGUMENT);
    CHECK(cuferry_ring_acquire(ring, 0, NULL, &host) == CUFERRY_STATUS_INVALID_ARGUMENT);
    CHECK(cuferry_ring_next(NULL, stream, 0, &item) == CUFERRY_STATUS_INVALID_ARGUMENT);
    OK(cuferry_ring_acquire(ring, 0, &slot, &host));
    CHECK(cuferry_ring_publish(slot, 5, slot_bytes + 1) == CUFERRY_STATUS_INVALID_ARGUMENT);
    size_t too_long = slot_bytes + 1;
    CHECK(cuferry_ring_produce(ring, sequences, source_ptrs, &too_long, 1, 1) == CUFERRY_STATUS_INVALID_ARGUMENT);
    OK(cuferry_ring_stats(ring, &stats));
    CHECK(stats.occupancy == 0 && stats.published == 10);
    /* Close: producers get CLOSED; consumers drain, then get CLOSED. */
    OK(cuferry_ring_acquire(ring, 0, &slot, &host));
    OK(cuferry_ring_publish(slot, 99, 8));
    OK(cuferry_ring_close(ring));
    CHECK(cuferry_ring_acquire(ring, -1, &slot, &host) == CUFERRY_STATUS_CLOSED);
    OK(cuferry_ring_next(ring, stream, -1, &item));
    OK(cuferry_ring_destroy(ring)); /* the held item stays valid */
    uint64_t seq = 0;
    OK(cuferry_ring_item_info(item, NULL, &seq, NULL));
    CHECK(seq == 99);
    OK(cuferry_ring_release(item));
    OK(cuferry_ring_destroy(NULL)); /* destroying NULL is a no-op, as for every handle */
    OK(cuferry_ring_abandon(NULL)); /* and so is giving back a NULL slot or item */
    OK(cuferry_ring_release(NULL));
  }

  /* Frees wait for queued copies; NULL frees are no-ops. */
  OK(cuferry_copy(stream, src, 0, dev1, 0, n));
  OK(cuferry_buffer_free(src));
  OK(cuferry_buffer_free(dev1));
  OK(cuferry_buffer_free(dev2));
  OK(cuferry_buffer_free(back));
  OK(cuferry_buffer_free(NULL));
  OK(cuferry_stream_synchronize(stream));
  OK(cuferry_stream_destroy(stream));
  OK(cuferry_stream_destroy(NULL));

  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("all C ABI checks passed\n");
  return 0;
}
