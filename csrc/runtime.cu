// runtime.cu: errors, versions, device queries and peer access.
//
// Rules: see cuferry_cuda.h. Names and strings come from static cudart and need no driver.
#include "common.cuh"

// The driver ABI asked for: 12.0's. The functions looked up have had the same signatures since
// then, and a request for a version newer than the driver's fails (a newer 13.x toolkit on an
// older 13.0 driver, under minor-version compatibility, would find nothing).
static const int kDriverAbiVersion = 12000;

// A driver function through the runtime's entry point (no link against libcuda): looking a
// symbol up needs no context, so it makes none. NULL when the driver lacks it.
static void *cf_driver_symbol(const char *name) {
  void *fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  // cf_check clears the last error only when this call set it (rule 3 of cuferry_cuda.h).
  if (cf_check(cudaGetDriverEntryPointByVersion(name, &fn, kDriverAbiVersion, cudaEnableDefault, &found)) !=
          CUFERRY_STATUS_SUCCESS ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return fn;
}

extern "C" {

const char *cuferry_cuda_status_name(cuferry_status status) {
  switch (status) {
    case CUFERRY_STATUS_NOT_BUILT:
      return "CUFERRY_STATUS_NOT_BUILT";
    case CUFERRY_STATUS_NULL_ARGUMENT:
      return "CUFERRY_STATUS_NULL_ARGUMENT";
    case CUFERRY_STATUS_BAD_ENUM:
      return "CUFERRY_STATUS_BAD_ENUM";
    case CUFERRY_STATUS_STAGE_RACE:
      return "CUFERRY_STATUS_STAGE_RACE";
    default:
      break;
  }
  if (status < 0) {
    return "CUFERRY_STATUS_UNKNOWN";
  }
  return cudaGetErrorName(static_cast<cudaError_t>(status));
}

const char *cuferry_cuda_status_string(cuferry_status status) {
  switch (status) {
    case CUFERRY_STATUS_NOT_BUILT:
      return "cuferry was built without nvcc";
    case CUFERRY_STATUS_NULL_ARGUMENT:
      return "a required pointer argument was NULL";
    case CUFERRY_STATUS_BAD_ENUM:
      return "an enum argument was out of range";
    case CUFERRY_STATUS_STAGE_RACE:
      return "two threads of a block used the same shared-memory stage bytes between barriers";
    default:
      break;
  }
  if (status < 0) {
    return "unknown cuferry status";
  }
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

cuferry_status cuferry_cuda_take_last_error(void) {
  return static_cast<cuferry_status>(cudaGetLastError());
}

cuferry_status cuferry_cuda_runtime_version(int32_t *version) {
  CF_REQUIRE(version);
  int v = 0;
  CF_TRY(cudaRuntimeGetVersion(&v));
  *version = v;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_driver_version(int32_t *version) {
  CF_REQUIRE(version);
  int v = 0;
  CF_TRY(cudaDriverGetVersion(&v));
  *version = v;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_device_count(int32_t *count) {
  CF_REQUIRE(count);
  int n = 0;
  CF_TRY(cudaGetDeviceCount(&n));
  *count = n;
  return CUFERRY_STATUS_SUCCESS;
}

static cuferry_status cf_attr(int32_t *out, cudaDeviceAttr attr, int device) {
  int v = 0;
  CF_TRY(cudaDeviceGetAttribute(&v, attr, device));
  *out = v;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_device_properties(int32_t device, cuferry_device_props *props) {
  CF_REQUIRE(props);
  cudaDeviceProp prop;
  CF_TRY(cudaGetDeviceProperties(&prop, device));
  cuferry_device_props out = {};
  for (size_t i = 0; i + 1 < sizeof(out.name) && i < sizeof(prop.name) && prop.name[i] != '\0'; ++i) {
    out.name[i] = prop.name[i];
  }
  out.total_global_mem = prop.totalGlobalMem;
  out.compute_major = prop.major;
  out.compute_minor = prop.minor;
  out.multiprocessor_count = prop.multiProcessorCount;
  out.l2_cache_size = prop.l2CacheSize;
  out.pci_domain_id = prop.pciDomainID;
  out.pci_bus_id = prop.pciBusID;
  out.pci_device_id = prop.pciDeviceID;
  out.integrated = prop.integrated;
  struct {
    int32_t *field;
    cudaDeviceAttr attr;
  } attrs[] = {
      {&out.async_engine_count, cudaDevAttrAsyncEngineCount},
      {&out.unified_addressing, cudaDevAttrUnifiedAddressing},
      {&out.managed_memory, cudaDevAttrManagedMemory},
      {&out.concurrent_managed_access, cudaDevAttrConcurrentManagedAccess},
      {&out.pageable_memory_access, cudaDevAttrPageableMemoryAccess},
      {&out.memory_pools_supported, cudaDevAttrMemoryPoolsSupported},
      {&out.host_register_supported, cudaDevAttrHostRegisterSupported},
      {&out.can_map_host_memory, cudaDevAttrCanMapHostMemory},
  };
  for (auto &a : attrs) {
    cuferry_status s = cf_attr(a.field, a.attr, device);
    if (s != CUFERRY_STATUS_SUCCESS) {
      return s;
    }
  }
  *props = out;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_device_mem_info(int32_t device, size_t *free_bytes, size_t *total_bytes) {
  CF_REQUIRE(free_bytes);
  CF_REQUIRE(total_bytes);
  CF_TRY(cudaSetDevice(device));
  size_t f = 0, t = 0;
  CF_TRY(cudaMemGetInfo(&f, &t));
  *free_bytes = f;
  *total_bytes = t;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_set_device(int32_t device) { return cf_check(cudaSetDevice(device)); }

cuferry_status cuferry_cuda_get_device(int32_t *device) {
  CF_REQUIRE(device);
  int d = 0;
  CF_TRY(cudaGetDevice(&d));
  *device = d;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_thread_has_context(int32_t *has) {
  CF_REQUIRE(has);
  // cuCtxGetCurrent through the runtime's driver entry point (no link against libcuda):
  // looking a symbol up needs no context, so asking makes none. Resolved once.
  using get_current_fn = int (*)(void **);
  static const get_current_fn get_current = reinterpret_cast<get_current_fn>(cf_driver_symbol("cuCtxGetCurrent"));
  if (get_current == nullptr) return cf_check(cudaErrorNotSupported);
  void *ctx = nullptr;
  if (get_current(&ctx) != 0) return cf_check(cudaErrorNotSupported);  // CUresult: 0 is success
  *has = ctx != nullptr ? 1 : 0;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_active_device(int32_t *device) {
  CF_REQUIRE(device);
  // cuDeviceGet and cuDevicePrimaryCtxGetState through the entry point, as above: reading a
  // primary context's state neither creates nor retains it.
  using device_get_fn = int (*)(int *, int);
  using get_state_fn = int (*)(int, unsigned *, int *);
  static const device_get_fn device_get = reinterpret_cast<device_get_fn>(cf_driver_symbol("cuDeviceGet"));
  static const get_state_fn get_state =
      reinterpret_cast<get_state_fn>(cf_driver_symbol("cuDevicePrimaryCtxGetState"));
  if (device_get == nullptr || get_state == nullptr) return cf_check(cudaErrorNotSupported);
  int count = 0;
  CF_TRY(cudaGetDeviceCount(&count));  // initialises the driver (cuInit), creates no context
  for (int i = 0; i < count; ++i) {
    int dev = 0;
    unsigned flags = 0;
    int active = 0;
    if (device_get(&dev, i) != 0 || get_state(dev, &flags, &active) != 0) return cf_check(cudaErrorNotSupported);
    if (active != 0) {
      *device = i;
      return CUFERRY_STATUS_SUCCESS;
    }
  }
  *device = -1;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_device_synchronize(int32_t device) {
  CF_TRY(cudaSetDevice(device));
  CF_TRY(cudaDeviceSynchronize());
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_device_can_access_peer(int32_t device, int32_t peer, int32_t *can_access) {
  CF_REQUIRE(can_access);
  int v = 0;
  CF_TRY(cudaDeviceCanAccessPeer(&v, device, peer));
  *can_access = v;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_device_enable_peer_access(int32_t device, int32_t peer) {
  CF_TRY(cudaSetDevice(device));
  cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
    return CUFERRY_STATUS_SUCCESS;
  }
  return cf_check(err);
}

cuferry_status cuferry_cuda_device_get_l2_fetch_granularity(int32_t device, size_t *bytes) {
  CF_REQUIRE(bytes);
  CF_TRY(cudaSetDevice(device));
  size_t v = 0;
  CF_TRY(cudaDeviceGetLimit(&v, cudaLimitMaxL2FetchGranularity));
  *bytes = v;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_device_set_l2_fetch_granularity(int32_t device, size_t bytes) {
  CF_TRY(cudaSetDevice(device));
  CF_TRY(cudaDeviceSetLimit(cudaLimitMaxL2FetchGranularity, bytes));
  return CUFERRY_STATUS_SUCCESS;
}

static_assert(CUFERRY_HOST_WAIT_AUTO == cudaDeviceScheduleAuto, "host wait values");
static_assert(CUFERRY_HOST_WAIT_SPIN == cudaDeviceScheduleSpin, "host wait values");
static_assert(CUFERRY_HOST_WAIT_YIELD == cudaDeviceScheduleYield, "host wait values");
static_assert(CUFERRY_HOST_WAIT_BLOCK == cudaDeviceScheduleBlockingSync, "host wait values");

cuferry_status cuferry_cuda_device_get_host_wait(int32_t device, uint32_t *schedule) {
  CF_REQUIRE(schedule);
  CF_TRY(cudaSetDevice(device));
  unsigned flags = 0;
  CF_TRY(cudaGetDeviceFlags(&flags));
  *schedule = flags & cudaDeviceScheduleMask;
  return CUFERRY_STATUS_SUCCESS;
}

cuferry_status cuferry_cuda_device_set_host_wait(int32_t device, uint32_t schedule) {
  switch (schedule) {
    case CUFERRY_HOST_WAIT_AUTO:
    case CUFERRY_HOST_WAIT_SPIN:
    case CUFERRY_HOST_WAIT_YIELD:
    case CUFERRY_HOST_WAIT_BLOCK:
      break;
    default:
      return CUFERRY_STATUS_BAD_ENUM;
  }
  CF_TRY(cudaSetDevice(device));
  unsigned flags = 0;
  CF_TRY(cudaGetDeviceFlags(&flags));
  // Only the scheduling bits change. cudaDeviceMapHost, which the read may report, is implicit
  // for the runtime and not passed back; cudaDeviceLmemResizeToMax is now always on.
  CF_TRY(cudaSetDeviceFlags((flags & cudaDeviceSyncMemops) | schedule));
  return CUFERRY_STATUS_SUCCESS;
}

}  // extern "C"
