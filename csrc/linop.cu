// linop.cu: the CUDA kernels of the linear operators: a strided element-wise map (copies,
// scaling, sums, concatenation, making views contiguous) and a strided contraction (Dense and
// Diagonal, any named-dim layout), for f32, f64 and their complex pairs.
//
// Rules: see the linop section of cuferry_cuda.h. Parameters travel by value (descriptors of a
// few hundred bytes), so no table upload is needed. Launch errors are returned; complex
// products use the plain formula (no fused multiply-add assumptions).
#include "common.cuh"

namespace {

constexpr int kThreads = 256;

template <typename T>
struct Ops {
  __host__ __device__ static T mul(T a, T b) { return a * b; }
  __host__ __device__ static T conj(T a) { return a; }
  __host__ __device__ static T from(double re, double) { return static_cast<T>(re); }
  __host__ __device__ static T zero() { return T(0); }
};

template <>
struct Ops<float2> {
  __host__ __device__ static float2 mul(float2 a, float2 b) {
    return make_float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
  }
  __host__ __device__ static float2 conj(float2 a) { return make_float2(a.x, -a.y); }
  __host__ __device__ static float2 from(double re, double im) {
    return make_float2(static_cast<float>(re), static_cast<float>(im));
  }
  __host__ __device__ static float2 zero() { return make_float2(0.f, 0.f); }
};

template <>
struct Ops<double2> {
  __host__ __device__ static double2 mul(double2 a, double2 b) {
    return make_double2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
  }
  __host__ __device__ static double2 conj(double2 a) { return make_double2(a.x, -a.y); }
  __host__ __device__ static double2 from(double re, double im) { return make_double2(re, im); }
  __host__ __device__ static double2 zero() { return make_double2(0.0, 0.0); }
};

__device__ __forceinline__ float add(float a, float b) { return a + b; }
__device__ __forceinline__ double add(double a, double b) { return a + b; }
__device__ __forceinline__ float2 add(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }
__device__ __forceinline__ double2 add(double2 a, double2 b) { return make_double2(a.x + b.x, a.y + b.y); }

// SCALE false: a plain copy or sum (alpha is 1), bit-exact (no multiply by 1 + 0i).
template <typename T, bool SCALE>
__global__ void map_kernel(cuferry_linop_map m, const T *__restrict__ src, T *dst, long long total, T alpha) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    long long rest = i;
    long long s = m.src_offset;
    long long d = m.dst_offset;
    for (int k = m.ndim - 1; k >= 0; --k) {
      const long long idx = rest % m.shape[k];
      rest /= m.shape[k];
      s += idx * m.src_strides[k];
      d += idx * m.dst_strides[k];
    }
    const T v = SCALE ? Ops<T>::mul(alpha, src[s]) : src[s];
    dst[d] = m.accumulate ? add(dst[d], v) : v;
  }
}

template <typename T>
__global__ void contract_kernel(cuferry_linop_contraction c, const T *__restrict__ x, const T *__restrict__ w,
                                T *out, long long outputs, long long reduced) {
  for (long long o = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; o < outputs;
       o += static_cast<long long>(gridDim.x) * blockDim.x) {
    // The output dims' indices (mixed radix, last dim fastest).
    long long rest = o;
    long long out_off = 0, x_base = c.x_offset, w_base = c.w_offset;
    for (int k = c.ndim - 1; k >= 0; --k) {
      if (c.out_strides[k] == 0) continue;
      const long long idx = rest % c.shape[k];
      rest /= c.shape[k];
      out_off += idx * c.out_strides[k];
      x_base += idx * c.x_strides[k];
      w_base += idx * c.w_strides[k];
    }
    T acc = Ops<T>::zero();
    for (long long r = 0; r < reduced; ++r) {
      long long rr = r, xo = x_base, wo = w_base;
      for (int k = c.ndim - 1; k >= 0; --k) {
        if (c.out_strides[k] != 0) continue;
        const long long idx = rr % c.shape[k];
        rr /= c.shape[k];
        xo += idx * c.x_strides[k];
        wo += idx * c.w_strides[k];
      }
      const T wv = c.conj ? Ops<T>::conj(w[wo]) : w[wo];
      acc = add(acc, Ops<T>::mul(wv, x[xo]));
    }
    out[out_off] = acc;
  }
}

unsigned blocks_for(long long n) {
  long long b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

long long map_total(const cuferry_linop_map &m) {
  long long total = 1;
  for (int k = 0; k < m.ndim; ++k) total *= m.shape[k];
  return total;
}

// The number of outputs and, per output, of reduced elements.
void contract_counts(const cuferry_linop_contraction &c, long long *outputs, long long *reduced) {
  *outputs = 1;
  *reduced = 1;
  for (int k = 0; k < c.ndim; ++k) {
    if (c.out_strides[k] != 0) {
      *outputs *= c.shape[k];
    } else {
      *reduced *= c.shape[k];
    }
  }
}

template <typename T>
cuferry_status launch_map(const cuferry_linop_map &m, long long total, const void *src, void *dst, double re,
                          double im, cudaStream_t s) {
  const T alpha = Ops<T>::from(re, im);
  const T *const from = static_cast<const T *>(src);
  T *const to = static_cast<T *>(dst);
  if (re == 1.0 && im == 0.0) {
    return cf_launch(map_kernel<T, false>, blocks_for(total), kThreads, s, m, from, to, total, alpha);
  }
  return cf_launch(map_kernel<T, true>, blocks_for(total), kThreads, s, m, from, to, total, alpha);
}

template <typename T>
cuferry_status launch_contract(const cuferry_linop_contraction &c, long long outputs, long long reduced, const void *x,
                               const void *w, void *out, cudaStream_t s) {
  return cf_launch(contract_kernel<T>, blocks_for(outputs), kThreads, s, c, static_cast<const T *>(x),
                   static_cast<const T *>(w), static_cast<T *>(out), outputs, reduced);
}

}  // namespace

extern "C" {

cuferry_status cuferry_cuda_linop_map(int32_t dtype, const cuferry_linop_map *map, const void *src, void *dst,
                                      double alpha_re, double alpha_im, cuferry_stream stream) {
  CF_REQUIRE(map);
  CF_REQUIRE(stream);
  if (map->ndim < 0 || map->ndim > CUFERRY_LINOP_MAX_DIMS) return CUFERRY_STATUS_BAD_ENUM;
  if (dtype < CUFERRY_LINOP_F32 || dtype > CUFERRY_LINOP_C64) return CUFERRY_STATUS_BAD_ENUM;
  // Nothing to do, and nothing touched: an empty buffer's address is NULL.
  const long long total = map_total(*map);
  if (total == 0) return CUFERRY_STATUS_SUCCESS;
  CF_REQUIRE(src);
  CF_REQUIRE(dst);
  const cudaStream_t s = cf_stream(stream);
  CF_TRY(cf_use_stream_device(s));
  switch (dtype) {
    case CUFERRY_LINOP_F32: return launch_map<float>(*map, total, src, dst, alpha_re, alpha_im, s);
    case CUFERRY_LINOP_F64: return launch_map<double>(*map, total, src, dst, alpha_re, alpha_im, s);
    case CUFERRY_LINOP_C32: return launch_map<float2>(*map, total, src, dst, alpha_re, alpha_im, s);
    case CUFERRY_LINOP_C64: return launch_map<double2>(*map, total, src, dst, alpha_re, alpha_im, s);
    default: return CUFERRY_STATUS_BAD_ENUM;
  }
}

cuferry_status cuferry_cuda_linop_contract(int32_t dtype, const cuferry_linop_contraction *c, const void *x,
                                           const void *w, void *out, cuferry_stream stream) {
  CF_REQUIRE(c);
  CF_REQUIRE(stream);
  if (c->ndim < 0 || c->ndim > CUFERRY_LINOP_MAX_DIMS) return CUFERRY_STATUS_BAD_ENUM;
  if (dtype < CUFERRY_LINOP_F32 || dtype > CUFERRY_LINOP_C64) return CUFERRY_STATUS_BAD_ENUM;
  long long outputs = 0, reduced = 0;
  contract_counts(*c, &outputs, &reduced);
  // No outputs: nothing to do. An empty reduction writes zeros without reading `x` or `w`,
  // which are then empty buffers (NULL addresses).
  if (outputs == 0) return CUFERRY_STATUS_SUCCESS;
  if (reduced > 0) {
    CF_REQUIRE(x);
    CF_REQUIRE(w);
  }
  CF_REQUIRE(out);
  const cudaStream_t s = cf_stream(stream);
  CF_TRY(cf_use_stream_device(s));
  switch (dtype) {
    case CUFERRY_LINOP_F32: return launch_contract<float>(*c, outputs, reduced, x, w, out, s);
    case CUFERRY_LINOP_F64: return launch_contract<double>(*c, outputs, reduced, x, w, out, s);
    case CUFERRY_LINOP_C32: return launch_contract<float2>(*c, outputs, reduced, x, w, out, s);
    case CUFERRY_LINOP_C64: return launch_contract<double2>(*c, outputs, reduced, x, w, out, s);
    default: return CUFERRY_STATUS_BAD_ENUM;
  }
}

}  // extern "C"
