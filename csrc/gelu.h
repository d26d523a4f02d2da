// GeLU and its derivative: the CUDA bias_gelu kernel's (_cuda); GeluKind is shared with the
// CPU extension (_C), whose kernel runs ATen's vectorised GeLU.
//
// exact ("none"): gelu(u)  = u * Phi(u),           Phi(u) = (1 + erf(u / sqrt 2)) / 2
//                 gelu'(u) = Phi(u) + u * phi(u),  phi(u) = exp(-u^2 / 2) / sqrt(2 pi)
// tanh:           gelu(u)  = u/2 * (1 + t),        t = tanh(k0 * (u + k1 u^3)),
//                 gelu'(u) = (1 + t)/2 + u/2 * (1 - t^2) * k0 * (1 + 3 k1 u^2),
//                 k0 = sqrt(2/pi), k1 = 0.044715.
// Arithmetic is done in `acc_t` (float for half/bfloat16/float, double for double).
#pragma once
#include <cmath>

#if defined(__CUDACC__)
#define DISTLLM_HD __host__ __device__ __forceinline__
#else
#define DISTLLM_HD inline
#endif

namespace distllm {

enum class GeluKind : int { Exact = 0, Tanh = 1 };

template <typename T>
DISTLLM_HD T gelu_fwd(T u, GeluKind kind) {
  if (kind == GeluKind::Exact) {
    return u * T(0.5) * (T(1) + erf(u * T(0.70710678118654752440)));
  }
  const T inner = T(0.79788456080286535588) * (u + T(0.044715) * u * u * u);
  return T(0.5) * u * (T(1) + tanh(inner));
}

template <typename T>
DISTLLM_HD T gelu_bwd(T u, GeluKind kind) {
  if (kind == GeluKind::Exact) {
    const T cdf = T(0.5) * (T(1) + erf(u * T(0.70710678118654752440)));
    const T pdf = exp(T(-0.5) * u * u) * T(0.39894228040143267794);
    return cdf + u * pdf;
  }
  const T k0 = T(0.79788456080286535588), k1 = T(0.044715);
  const T t = tanh(k0 * (u + k1 * u * u * u));
  return T(0.5) * (T(1) + t) + T(0.5) * u * (T(1) - t * t) * k0 * (T(1) + T(3) * k1 * u * u);
}

}  // namespace distllm
