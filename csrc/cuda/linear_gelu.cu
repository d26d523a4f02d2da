// cuBLASLt GEMMs with fused epilogues for linear + bias + GeLU (tanh form only).
//
// cuBLASLt's GELU epilogues implement the tanh approximation
//   gelu(u) = u/2 * (1 + tanh(sqrt(2/pi) * (u + 0.044715 u^3))),
// so these ops serve approximate="tanh"; the Python dispatcher routes "none" (erf) elsewhere.
//
// Row-major tensors are handed to cuBLASLt (column-major) as their transposes:
// a row-major (r, c) matrix is a column-major (c, r) matrix with the same leading dimension c.
//
//   distllm::cublaslt_linear_gelu(x (M,K), w (N,K), bias? (N,), save_pre) -> (y (M,N), pre)
//       D^T(N,M) = op_T(w^T)(N,K) . x^T(K,M); epilogue GELU_AUX_BIAS (or GELU_AUX without bias,
//       GELU_BIAS / GELU when the pre-activation is not kept): y = gelu(pre), pre = xW^T + b
//       written as the aux matrix (ld N). pre is empty((0,)) when save_pre is false.
//   distllm::cublaslt_dgelu_bgrad(dy (M,P), w2 (P,N), pre (M,N)) -> (dpre (M,N), dbias (N,))
//       dpre = (dy @ w2) * gelu'(pre), dbias = dpre.sum(0): epilogue DGELU_BGRAD. This is the
//       backward of gelu(pre) fused into the data-gradient GEMM of the layer that consumes y
//       (the second MLP GEMM); it needs that GEMM, so it is exposed for callers that own it.
//   distllm::cublaslt_wgrad_bgrad(gpre (M,N), x (M,K), with_bias) -> (dw (N,K), dbias)
//       dw = gpre^T @ x; epilogue BGRADB fuses dbias = gpre.sum(0) into the weight-grad GEMM.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <tuple>

namespace distllm {
namespace {

#define LT_CHECK(expr)                                                                      \
  do {                                                                                      \
    cublasStatus_t st_ = (expr);                                                            \
    TORCH_CHECK(st_ == CUBLAS_STATUS_SUCCESS, "cuBLASLt call failed: ", #expr, " status=", \
                static_cast<int>(st_));                                                     \
  } while (0)

cudaDataType_t lt_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: TORCH_CHECK(false, "cuBLASLt linear_gelu supports float32, float16, bfloat16; got ", t);
  }
}

// RAII owners of the cuBLASLt descriptors of one call.
struct Desc {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Desc() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

struct Gemm {
  // Column-major D(m, n) = op(A)(m, k) . op(B)(k, n), all in the same dtype.
  bool ta = false, tb = false;
  int64_t m = 0, n = 0, k = 0;
  const void* A = nullptr;  // stored (ta ? k x m : m x k) column-major, leading dim lda
  int64_t lda = 0;
  const void* B = nullptr;  // stored (tb ? n x k : k x n) column-major, leading dim ldb
  int64_t ldb = 0;
  void* D = nullptr;        // m x n column-major, leading dim ldd
  int64_t ldd = 0;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  void* bias = nullptr;     // bias (input) or bias gradient (output), per the epilogue
  void* aux = nullptr;      // GeLU pre-activation, m x n with leading dim aux_ld
  int64_t aux_ld = 0;
};

void run_gemm(const Gemm& g, at::ScalarType st, const at::Device& dev) {
  const cudaDataType_t dt = lt_dtype(st);
  const cublasComputeType_t ct = CUBLAS_COMPUTE_32F;
  Desc desc;
  LT_CHECK(cublasLtMatmulDescCreate(&desc.op, ct, CUDA_R_32F));
  const cublasOperation_t opa = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  LT_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  LT_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &g.epilogue,
                                          sizeof(g.epilogue)));
  if (g.bias != nullptr) {
    LT_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                            sizeof(g.bias)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &dt,
                                            sizeof(dt)));
  }
  if (g.aux != nullptr) {
    LT_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                            &g.aux, sizeof(g.aux)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                            &g.aux_ld, sizeof(g.aux_ld)));
    // The aux matrix takes D's type by default (the attribute is for fp8 outputs).
  }
  LT_CHECK(cublasLtMatrixLayoutCreate(&desc.a, dt, g.ta ? g.k : g.m, g.ta ? g.m : g.k, g.lda));
  LT_CHECK(cublasLtMatrixLayoutCreate(&desc.b, dt, g.tb ? g.n : g.k, g.tb ? g.k : g.n, g.ldb));
  LT_CHECK(cublasLtMatrixLayoutCreate(&desc.d, dt, g.m, g.n, g.ldd));

  // Workspace from the caching allocator (32 MiB is what Hopper kernels may ask for).
  const size_t ws_size = 32u << 20;
  at::Tensor ws = at::empty({static_cast<int64_t>(ws_size)},
                            at::TensorOptions().dtype(at::kByte).device(dev));
  LT_CHECK(cublasLtMatmulPreferenceCreate(&desc.pref));
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size, sizeof(ws_size)));
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  LT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d,
                                          desc.pref, 1, &heur, &found));
  TORCH_CHECK(found > 0, "cuBLASLt found no algorithm for epilogue ", static_cast<int>(g.epilogue),
              " with m=", g.m, " n=", g.n, " k=", g.k,
              " (leading dimensions must be multiples of 8 elements)");
  const float alpha = 1.f, beta = 0.f;
  LT_CHECK(cublasLtMatmul(handle, desc.op, &alpha, g.A, desc.a, g.B, desc.b, &beta, g.D, desc.d,
                          g.D, desc.d, &heur.algo, ws.data_ptr(), ws_size,
                          at::cuda::getCurrentCUDAStream()));
}

void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.is_contiguous(), "cublaslt: ", name,
              " must be a contiguous 2-D CUDA tensor, got sizes ", t.sizes());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cublaslt_linear_gelu(const at::Tensor& x, const at::Tensor& w,
                                                        const c10::optional<at::Tensor>& bias,
                                                        bool save_pre) {
  check_2d(x, "x");
  check_2d(w, "weight");
  TORCH_CHECK(x.size(1) == w.size(1), "cublaslt_linear_gelu: in-features differ");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "cublaslt_linear_gelu: dtypes differ");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor pre = save_pre ? at::empty({M, N}, x.options()) : at::empty({0}, x.options());
  if (M == 0 || N == 0) return {y, pre};
  Gemm g;
  g.ta = true;                       // A = w stored (K, N) column-major, op T -> (N, K)
  g.m = N; g.n = M; g.k = K;
  g.A = w.data_ptr(); g.lda = K;
  g.B = x.data_ptr(); g.ldb = K;     // x stored (K, M) column-major
  g.D = y.data_ptr(); g.ldd = N;     // y^T (N, M) column-major == y (M, N) row-major
  const bool has_bias = bias.has_value();
  if (has_bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(),
                "cublaslt_linear_gelu: bias must be a contiguous (", N, ",) tensor of x's dtype");
    g.bias = const_cast<void*>(bias->data_ptr());
  }
  if (save_pre) {
    g.aux = pre.data_ptr();
    g.aux_ld = N;
    g.epilogue = has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  } else {
    g.epilogue = has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
  }
  run_gemm(g, x.scalar_type(), x.device());
  return {y, pre};
}

std::tuple<at::Tensor, at::Tensor> cublaslt_dgelu_bgrad(const at::Tensor& dy, const at::Tensor& w2,
                                                        const at::Tensor& pre) {
  check_2d(dy, "dy");
  check_2d(w2, "w2");
  check_2d(pre, "pre");
  const int64_t M = dy.size(0), P = dy.size(1), N = w2.size(1);
  TORCH_CHECK(w2.size(0) == P && pre.size(0) == M && pre.size(1) == N,
              "cublaslt_dgelu_bgrad: expected dy (M,P), w2 (P,N), pre (M,N)");
  c10::cuda::CUDAGuard guard(dy.device());
  at::Tensor dpre = at::empty({M, N}, dy.options());
  at::Tensor dbias = at::zeros({N}, dy.options());
  if (M == 0 || N == 0) return {dpre, dbias};
  Gemm g;                              // dpre^T (N, M) = w2^T (N, P) . dy^T (P, M)
  g.m = N; g.n = M; g.k = P;
  g.A = w2.data_ptr(); g.lda = N;      // w2 stored (N, P) column-major
  g.B = dy.data_ptr(); g.ldb = P;      // dy stored (P, M) column-major
  g.D = dpre.data_ptr(); g.ldd = N;
  g.epilogue = CUBLASLT_EPILOGUE_DGELU_BGRAD;
  g.bias = dbias.data_ptr();           // bias gradient: reduced over the columns of D (over M)
  g.aux = const_cast<void*>(pre.data_ptr());
  g.aux_ld = N;
  run_gemm(g, dy.scalar_type(), dy.device());
  return {dpre, dbias};
}

std::tuple<at::Tensor, at::Tensor> cublaslt_wgrad_bgrad(const at::Tensor& gpre, const at::Tensor& x,
                                                        bool with_bias) {
  check_2d(gpre, "gpre");
  check_2d(x, "x");
  const int64_t M = gpre.size(0), N = gpre.size(1), K = x.size(1);
  TORCH_CHECK(x.size(0) == M, "cublaslt_wgrad_bgrad: gpre and x differ in rows");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dw = at::empty({N, K}, x.options());
  at::Tensor db = with_bias ? at::zeros({N}, x.options()) : at::empty({0}, x.options());
  if (N == 0 || K == 0) return {dw, db};
  if (M == 0) return {dw.zero_(), db};
  Gemm g;                              // dw^T (K, N) = x^T (K, M) . gpre (M, N)
  g.m = K; g.n = N; g.k = M;
  g.A = x.data_ptr(); g.lda = K;       // x stored (K, M) column-major, op N
  g.tb = true;                         // gpre stored (N, M) column-major, op T -> (M, N)
  g.B = gpre.data_ptr(); g.ldb = N;
  g.D = dw.data_ptr(); g.ldd = K;      // dw^T (K, N) column-major == dw (N, K) row-major
  if (with_bias) {
    g.epilogue = CUBLASLT_EPILOGUE_BGRADB;  // db[n] = sum_m gpre[m, n], columns of D
    g.bias = db.data_ptr();
  }
  run_gemm(g, x.scalar_type(), x.device());
  return {dw, db};
}

}  // namespace distllm

TORCH_LIBRARY_FRAGMENT(distllm, m) {
  m.def("cublaslt_linear_gelu(Tensor x, Tensor weight, Tensor? bias, bool save_pre) -> (Tensor, Tensor)");
  m.def("cublaslt_dgelu_bgrad(Tensor dy, Tensor w2, Tensor pre) -> (Tensor, Tensor)");
  m.def("cublaslt_wgrad_bgrad(Tensor gpre, Tensor x, bool with_bias) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(distllm, CUDA, m) {
  m.impl("cublaslt_linear_gelu", &distllm::cublaslt_linear_gelu);
  m.impl("cublaslt_dgelu_bgrad", &distllm::cublaslt_dgelu_bgrad);
  m.impl("cublaslt_wgrad_bgrad", &distllm::cublaslt_wgrad_bgrad);
}
