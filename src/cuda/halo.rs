//! C ABI calls of the halo kernels (csrc/halo.cu).
