// cuBLASLt GEMMs with fused epilogues for linear + bias + GeLU (tanh form only).
//
// cuBLASLt's GELU epilogues implement the tanh approximation
//   gelu(u) = u/2 * (1 + tanh(sqrt(2/pi) * (u + 0.044715 u^3))),
// so these functions serve approximate="tanh"; the Python dispatch routes "none" (erf)
// elsewhere.
//
// Row-major tensors are handed to cuBLASLt (column-major) as their transposes:
// a row-major (r, c) matrix is a column-major (c, r) matrix with the same leading dimension c.
//
// These are kernels of distllm._cuda, called from the linear_gelu op's "cuda" backend
// (distllm/ops/linear_gelu_backends.py); they are not ops of their own.
//
//   cublaslt_linear_gelu(x (M,K), w (N,K), bias? (N,), save_pre) -> (y (M,N), pre)
//       D^T(N,M) = op_T(w^T)(N,K) . x^T(K,M); epilogue GELU_AUX_BIAS (or GELU_AUX without bias,
//       GELU_BIAS / GELU when the pre-activation is not kept): y = gelu(pre), pre = xW^T + b
//       written as the aux matrix (ld N). pre is empty((0,)) when save_pre is false.
//   cublaslt_dgelu_bgrad(dy (M,P), w2 (P,N), pre (M,N)) -> (dpre (M,N), dbias (N,))
//       dpre = (dy @ w2) * gelu'(pre), dbias = dpre.sum(0): epilogue DGELU_BGRAD. This is the
//       backward of gelu(pre) fused into the data-gradient GEMM of the layer that consumes y
//       (the second MLP GEMM); it needs that GEMM, so it is exposed for callers that own it.
//   cublaslt_wgrad_bgrad(gpre (M,N), x (M,K), with_bias) -> (dw (N,K), dbias)
//       dw = gpre^T @ x; epilogue BGRADB fuses dbias = gpre.sum(0) into the weight-grad GEMM.
//
// Every function takes `allow_tf32` (the caller passes torch.backends.cuda.matmul.allow_tf32):
// float32 operands then use CUBLAS_COMPUTE_32F_FAST_TF32, else CUBLAS_COMPUTE_32F.
// The preference's minimum alignments of A, B, C and D are those of the actual pointers
// (cuBLASLt assumes 256 bytes otherwise, and may pick a kernel that faults on a tensor that
// starts 16 bytes into an allocation). When cuBLASLt offers no algorithm they raise
// NotImplementedError (c10::NotImplementedError), which the Python dispatch catches to use
// the next backend; other failures are RuntimeErrors.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <cstdint>
#include <tuple>

#include "../checks.h"
#include "ops.h"

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

// Largest power of two dividing the address, capped at 256 (cuBLASLt's default assumption).
uint32_t alignment_bytes(const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 1;
  while (a < 256 && addr % (2 * a) == 0) a *= 2;
  return a;
}

cublasComputeType_t compute_type(at::ScalarType st, bool allow_tf32) {
  return (st == at::kFloat && allow_tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

void set_epilogue(const Gemm& g, cublasLtMatmulDesc_t op, cudaDataType_t dt) {
  LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &g.epilogue,
                                          sizeof(g.epilogue)));
  if (g.bias != nullptr) {
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                            sizeof(g.bias)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &dt,
                                            sizeof(dt)));
  }
  if (g.aux != nullptr) {
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                            &g.aux, sizeof(g.aux)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                            &g.aux_ld, sizeof(g.aux_ld)));
    // The aux matrix takes D's type by default (the attribute is for fp8 outputs).
  }
}

void set_preference(const Gemm& g, cublasLtMatmulPreference_t pref, size_t ws_size) {
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &ws_size, sizeof(ws_size)));
  const uint32_t align[4] = {alignment_bytes(g.A), alignment_bytes(g.B), alignment_bytes(g.D),
                             alignment_bytes(g.D)};  // C is D (beta = 0, in place)
  const cublasLtMatmulPreferenceAttributes_t attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr[i], &align[i], sizeof(align[i])));
  }
}

void run_gemm(const Gemm& g, at::ScalarType st, bool allow_tf32) {
  const cudaDataType_t dt = lt_dtype(st);
  Desc desc;
  LT_CHECK(cublasLtMatmulDescCreate(&desc.op, compute_type(st, allow_tf32), CUDA_R_32F));
  const cublasOperation_t opa = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  LT_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  set_epilogue(g, desc.op, dt);
  LT_CHECK(cublasLtMatrixLayoutCreate(&desc.a, dt, g.ta ? g.k : g.m, g.ta ? g.m : g.k, g.lda));
  LT_CHECK(cublasLtMatrixLayoutCreate(&desc.b, dt, g.tb ? g.n : g.k, g.tb ? g.k : g.n, g.ldb));
  LT_CHECK(cublasLtMatrixLayoutCreate(&desc.d, dt, g.m, g.n, g.ldd));

  // torch's own cuBLASLt workspace for this handle and stream (the one its addmm epilogues
  // use; its size is torch's, CUBLASLT_WORKSPACE_SIZE): no allocation per call.
  const size_t ws_size = at::cuda::getCUDABlasLtWorkspaceSize();
  void* ws = at::cuda::getCUDABlasLtWorkspace();
  LT_CHECK(cublasLtMatmulPreferenceCreate(&desc.pref));
  set_preference(g, desc.pref, ws_size);
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  const cublasStatus_t st_heur = cublasLtMatmulAlgoGetHeuristic(
      handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref, 1, &heur, &found);
  // No algorithm for these inputs (NOT_SUPPORTED, or none found): NotImplementedError in
  // Python, and the dispatch falls back to the next backend. Any other status is a mistake in
  // the descriptors (INVALID_VALUE: a bad ld, type or epilogue pairing) and must not be hidden
  // by a fallback that gives the right numbers: a RuntimeError.
  const auto what = [&] {
    return c10::str("epilogue ", static_cast<int>(g.epilogue), " (", st, ", m=", g.m,
                    " n=", g.n, " k=", g.k, ", alignments A/B/D ", alignment_bytes(g.A), "/",
                    alignment_bytes(g.B), "/", alignment_bytes(g.D), " bytes)");
  };
  TORCH_CHECK(st_heur == CUBLAS_STATUS_SUCCESS || st_heur == CUBLAS_STATUS_NOT_SUPPORTED,
              "cuBLASLt's heuristic failed with status ", static_cast<int>(st_heur), " for ",
              what());
  TORCH_CHECK_NOT_IMPLEMENTED(st_heur == CUBLAS_STATUS_SUCCESS && found > 0,
                              "cuBLASLt found no algorithm for ", what(), ", heuristic status ",
                              static_cast<int>(st_heur), ", ", found, " results");
  const float alpha = 1.f, beta = 0.f;
  LT_CHECK(cublasLtMatmul(handle, desc.op, &alpha, g.A, desc.a, g.B, desc.b, &beta, g.D, desc.d,
                          g.D, desc.d, &heur.algo, ws, ws_size,
                          at::cuda::getCurrentCUDAStream()));
}

// A contiguous 2-D CUDA tensor with the device and dtype of `like` (named `ref`).
void check_operand(const at::Tensor& t, const char* op, const char* arg, const at::Tensor& like,
                   const char* ref) {
  DISTLLM_CHECK_DEVICE_TYPE(t, c10::DeviceType::CUDA, op, arg);
  DISTLLM_CHECK_ARG(t.dim() == 2 && t.is_contiguous(), op, arg,
                    "must be a contiguous 2-D tensor, got sizes ", t.sizes(), " and strides ",
                    t.strides());
  check_like(t, like, op, arg, ref);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cublaslt_linear_gelu(const at::Tensor& x, const at::Tensor& w,
                                                        const std::optional<at::Tensor>& bias,
                                                        bool save_pre, bool allow_tf32) {
  const char* op = "cublaslt_linear_gelu";
  check_operand(x, op, "x", x, "x");
  check_operand(w, op, "weight", x, "x");
  DISTLLM_CHECK_ARG(x.size(1) == w.size(1), op, "weight", "has ", w.size(1),
                    " in-features but x has ", x.size(1));
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const bool has_bias = bias.has_value();
  if (has_bias) {
    DISTLLM_CHECK_ARG(bias->is_contiguous() && bias->dim() == 1 && bias->numel() == N, op, "bias",
                      "must be a contiguous (", N, ",) tensor, got sizes ", bias->sizes());
    check_like(*bias, x, op, "bias", "x");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor pre = save_pre ? at::empty({M, N}, x.options()) : at::empty({0}, x.options());
  if (M == 0 || N == 0) return {y, pre};
  Gemm g;
  g.ta = true;                       // A = w stored (K, N) column-major, op T -> (N, K)
  g.m = N; g.n = M; g.k = K;
  g.A = w.data_ptr(); g.lda = K;
  g.B = x.data_ptr(); g.ldb = K;     // x stored (K, M) column-major
  g.D = y.data_ptr(); g.ldd = N;     // y^T (N, M) column-major == y (M, N) row-major
  if (has_bias) g.bias = const_cast<void*>(bias->data_ptr());
  if (save_pre) {
    g.aux = pre.data_ptr();
    g.aux_ld = N;
    g.epilogue = has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  } else {
    g.epilogue = has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
  }
  run_gemm(g, x.scalar_type(), allow_tf32);
  return {y, pre};
}

std::tuple<at::Tensor, at::Tensor> cublaslt_dgelu_bgrad(const at::Tensor& dy, const at::Tensor& w2,
                                                        const at::Tensor& pre, bool allow_tf32) {
  const char* op = "cublaslt_dgelu_bgrad";
  check_operand(dy, op, "dy", dy, "dy");
  check_operand(w2, op, "w2", dy, "dy");
  check_operand(pre, op, "pre", dy, "dy");
  const int64_t M = dy.size(0), P = dy.size(1), N = w2.size(1);
  DISTLLM_CHECK_ARG(w2.size(0) == P, op, "w2", "must be (P, N) with P = dy.size(1) = ", P,
                    ", got ", w2.sizes());
  DISTLLM_CHECK_ARG(pre.size(0) == M && pre.size(1) == N, op, "pre", "must be (", M, ", ", N,
                    "), got ", pre.sizes());
  c10::cuda::CUDAGuard guard(dy.device());
  at::Tensor dpre = at::empty({M, N}, dy.options());
  at::Tensor dbias = at::zeros({N}, dy.options());
  if (M == 0 || N == 0) return {dpre, dbias};
  if (P == 0) return {dpre.zero_(), dbias};  // dy @ w2 is 0: so are dpre and its sum
  Gemm g;                              // dpre^T (N, M) = w2^T (N, P) . dy^T (P, M)
  g.m = N; g.n = M; g.k = P;
  g.A = w2.data_ptr(); g.lda = N;      // w2 stored (N, P) column-major
  g.B = dy.data_ptr(); g.ldb = P;      // dy stored (P, M) column-major
  g.D = dpre.data_ptr(); g.ldd = N;
  g.epilogue = CUBLASLT_EPILOGUE_DGELU_BGRAD;
  g.bias = dbias.data_ptr();           // bias gradient: reduced over the columns of D (over M)
  g.aux = const_cast<void*>(pre.data_ptr());
  g.aux_ld = N;
  run_gemm(g, dy.scalar_type(), allow_tf32);
  return {dpre, dbias};
}

std::tuple<at::Tensor, at::Tensor> cublaslt_wgrad_bgrad(const at::Tensor& gpre, const at::Tensor& x,
                                                        bool with_bias, bool allow_tf32) {
  const char* op = "cublaslt_wgrad_bgrad";
  check_operand(x, op, "x", x, "x");
  check_operand(gpre, op, "gpre", x, "x");
  const int64_t M = gpre.size(0), N = gpre.size(1), K = x.size(1);
  DISTLLM_CHECK_ARG(x.size(0) == M, op, "x", "has ", x.size(0), " rows but gpre has ", M);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dw = at::empty({N, K}, x.options());
  at::Tensor db = with_bias ? at::zeros({N}, x.options()) : at::empty({0}, x.options());
  if (N == 0) return {dw, db};
  if (K == 0) return {dw, with_bias ? gpre.sum(0) : db};  // no dW GEMM; the bias gradient is
  if (M == 0) return {dw.zero_(), db};                     // still gpre's column sums
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
  run_gemm(g, x.scalar_type(), allow_tf32);
  return {dw, db};
}

}  // namespace distllm
