// Matmul + bias (+ GELU) through cuBLASLt epilogues: the CUDA kernels behind flash_backend/ops/dense.py.
//
// Trade-off: cuBLASLt fuses the bias add, the GELU and the store of the pre-activation into the GEMM's
// epilogue, so the forward costs one GEMM and no elementwise pass, and the bias gradient rides on the
// weight-gradient GEMM (BGRADB) instead of a separate reduction over the (M, N) gradient. Its GELU
// epilogues are the tanh approximation only: the Python side sends approximate="none" through the BIAS
// epilogue and an erf GELU, never through these.
//
// Everything here is row-major PyTorch (x: (M, K), weight: (N, K) as in nn.Linear) mapped onto
// cuBLASLt's column-major GEMM: a row-major (R, C) matrix is a column-major (C, R) one with ld = C.
// Inputs are checked (and made contiguous) on the Python side; the TORCH_CHECKs below guard the ABI.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// Hopper kernels want a large workspace (PyTorch gives cuBLASLt 32 MiB on sm_90 too).
constexpr size_t kWorkspaceBytes = 32u << 20;

void check_lt(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "flash dense (cuBLASLt): ", what, " failed: ",
              cublasLtGetStatusString(status));
}

struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  MatmulDesc() { check_lt(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate"); }
  ~MatmulDesc() { cublasLtMatmulDescDestroy(desc); }
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
    check_lt(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(T)), "MatmulDescSetAttribute");
  }
};

struct Layout {
  cublasLtMatrixLayout_t layout = nullptr;
  Layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
    check_lt(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld), "MatrixLayoutCreate");
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(layout); }
};

struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  Preference() { check_lt(cublasLtMatmulPreferenceCreate(&pref), "MatmulPreferenceCreate"); }
  ~Preference() { cublasLtMatmulPreferenceDestroy(pref); }
  template <typename T>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(T)), "MatmulPreferenceSetAttribute");
  }
};

// One column-major GEMM D(m, n) = op(A)(m, k) @ op(B)(k, n) with an epilogue. `bias` is the bias read by
// the BIAS* epilogues or the bias gradient written by the *BGRAD* ones; `aux` the GELU input (written by
// GELU_AUX*, read by DGELU*).
struct LtGemm {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  void* bias = nullptr;
  void* aux = nullptr;
  int64_t ldaux = 0;
};

uint32_t alignment(const void* p) {
  auto addr = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && addr % align != 0) align /= 2;
  return align;
}

// The heuristic query costs tens of microseconds of CPU per call: cache its pick per problem.
std::mutex algo_mutex;
std::unordered_map<std::string, cublasLtMatmulAlgo_t> algo_cache;

// The fastest of `candidates`, timed on the stream: its index, with each candidate's median round in
// `best_ms` (negative where the candidate failed). Each candidate is timed in kRounds interleaved rounds of
// kRepsPerRound calls, the order reversed every other round, and scored by its median round. Why not the
// fastest round (the scheme until 6f4c0d7): at GEMMs of milliseconds the chip runs at its boost clock for
// the first tens of milliseconds and then at its power limit, so the fastest round of each candidate was
// the first one, and the candidates timed first won (at 16384 x 16384 x 4096 the kept candidate's first
// round measured 2.87 ms and the same kernel 3.43 ms in a steady graph replay). The median is what the
// candidate does at the clock it will run at; the reversed order keeps any drift within a round from
// favouring the same candidates every time.
template <typename Matmul>
int fastest_candidate(const std::vector<cublasLtMatmulAlgo_t>& candidates, Matmul& matmul, cudaStream_t stream,
                      std::vector<float>& best_ms) {
  constexpr int kRounds = 5, kRepsPerRound = 2;
  const int found = static_cast<int>(candidates.size());
  best_ms.assign(found, -1.0f);
  std::vector<bool> usable(found, false);
  for (int i = 0; i < found; ++i) usable[i] = matmul(candidates[i]) == CUBLAS_STATUS_SUCCESS;  // warm-up
  std::vector<cudaEvent_t> events(2 * kRounds * found);
  for (auto& e : events) C10_CUDA_CHECK(cudaEventCreate(&e));
  for (int round = 0; round < kRounds; ++round) {
    for (int j = 0; j < found; ++j) {
      const int i = round % 2 == 0 ? j : found - 1 - j;
      if (!usable[i]) continue;
      cudaEvent_t* pair = &events[2 * (round * found + i)];
      C10_CUDA_CHECK(cudaEventRecord(pair[0], stream));
      for (int rep = 0; rep < kRepsPerRound; ++rep) check_lt(matmul(candidates[i]), "Matmul (timing)");
      C10_CUDA_CHECK(cudaEventRecord(pair[1], stream));
    }
  }
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  int best = 0;
  for (int i = 0; i < found; ++i) {
    if (!usable[i]) continue;
    std::vector<float> rounds_ms;
    for (int round = 0; round < kRounds; ++round) {
      cudaEvent_t* pair = &events[2 * (round * found + i)];
      float ms = 0.0f;
      C10_CUDA_CHECK(cudaEventElapsedTime(&ms, pair[0], pair[1]));
      rounds_ms.push_back(ms / kRepsPerRound);
    }
    std::nth_element(rounds_ms.begin(), rounds_ms.begin() + kRounds / 2, rounds_ms.end());
    best_ms[i] = rounds_ms[kRounds / 2];
    if (best_ms[best] < 0.0f || best_ms[i] < best_ms[best]) best = i;
  }
  for (auto& e : events) C10_CUDA_CHECK(cudaEventDestroy(e));
  return best;
}

template <typename T>
T algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written);
  return value;
}

// Configurations of cuBLASLt's Hopper GEMM kernel family (algorithm id 66 in cuBLAS 13.0) that its heuristic
// does not offer, as (tile id, custom option, cluster shape id). A search over every tile, custom option
// and cluster shape of that family (bench/cublaslt_config_search.{py,cpp},
// bench/logs/cublaslt_config_search*_h200.log) found them 2-12 % faster than the heuristic's best candidate
// at bench_dense's problems on the H200:
// GELU_AUX_BIAS forwards (tiles 28, 208), bias-only forwards (407, 408, 29), weight gradients (151, 458).
// They are candidates only: each is derived from the heuristic's own id-66 pick, must pass
// cublasLtMatmulAlgoCheck for the problem, and is timed with the heuristic's candidates. Where a cuBLAS
// version means something else by these ids, the cost is a few failed checks or timing calls.
struct ExtraConfig {
  uint32_t tile;
  uint32_t custom;
  uint16_t cluster;
};
constexpr int32_t kExtraConfigsAlgoId = 66;
constexpr ExtraConfig kExtraConfigs[] = {
    {28, 0, 3}, {28, 2, 3},  {208, 0, 5}, {408, 1, 3}, {407, 3, 3}, {29, 1, 3},
    {151, 2, 5}, {151, 2, 2}, {458, 3, 5}, {458, 1, 2}, {31, 6, 5}, {179, 2, 5},
};

// kExtraConfigs applied to the first of the heuristic's candidates of kExtraConfigsAlgoId, those the problem
// accepts, without repeating a candidate the heuristic already offered.
std::vector<cublasLtMatmulAlgo_t> extra_candidates(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                                   cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                   cublasLtMatrixLayout_t d,
                                                   const std::vector<cublasLtMatmulAlgo_t>& offered) {
  auto same_config = [](const cublasLtMatmulAlgo_t& x, const cublasLtMatmulAlgo_t& y) {
    auto u32 = [](const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
      return algo_config<uint32_t>(algo, attr);
    };
    return u32(x, CUBLASLT_ALGO_CONFIG_TILE_ID) == u32(y, CUBLASLT_ALGO_CONFIG_TILE_ID) &&
           u32(x, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION) == u32(y, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION) &&
           u32(x, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) == u32(y, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) &&
           algo_config<uint16_t>(x, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID) ==
               algo_config<uint16_t>(y, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
  };
  std::vector<cublasLtMatmulAlgo_t> extras;
  const cublasLtMatmulAlgo_t* base = nullptr;
  for (const auto& algo : offered) {
    if (algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID) == kExtraConfigsAlgoId) {
      base = &algo;
      break;
    }
  }
  if (base == nullptr) return extras;
  for (const ExtraConfig& extra : kExtraConfigs) {
    cublasLtMatmulAlgo_t algo = *base;
    const uint32_t splitk = 1;
    if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &extra.tile, sizeof(extra.tile)) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &extra.custom,
                                             sizeof(extra.custom)) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &extra.cluster,
                                             sizeof(extra.cluster)) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk)) !=
            CUBLAS_STATUS_SUCCESS)
      continue;
    cublasLtMatmulHeuristicResult_t checked{};
    if (cublasLtMatmulAlgoCheck(handle, desc, a, b, d, d, &algo, &checked) != CUBLAS_STATUS_SUCCESS ||
        checked.state != CUBLAS_STATUS_SUCCESS || checked.workspaceSize > kWorkspaceBytes)
      continue;
    bool repeat = false;
    for (const auto& other : offered) repeat = repeat || same_config(algo, other);
    if (!repeat) extras.push_back(algo);
  }
  return extras;
}

// "id 66 tile 28 stages 35 splitk 1 custom 0 cluster 3": enough to tell two processes' picks apart in a log.
std::string describe_algo(const cublasLtMatmulAlgo_t& algo) {
  return "id " + std::to_string(algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID)) + " tile " +
         std::to_string(algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID)) + " stages " +
         std::to_string(algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID)) + " splitk " +
         std::to_string(algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM)) + " custom " +
         std::to_string(algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION)) + " cluster " +
         std::to_string(algo_config<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
}

// What run_gemm picked for each problem it timed, for flash_backend's debug log (cublaslt_algo_picks).
std::vector<std::string> algo_picks;

// For tests only (flash::cublaslt_force_candidate): >= 0 makes run_gemm use that candidate of a problem's
// list (the heuristic's, then kExtraConfigs) instead of timing them, so every configuration it might keep
// can be checked against a reference. -1: measure, as always.
int64_t forced_candidate = -1;

void run_gemm(const LtGemm& g, at::ScalarType dtype, const at::Device& device) {
  const cudaDataType_t type = dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;

  MatmulDesc desc;
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(op_a));
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(op_b));
  desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(g.epilogue));
  if (g.bias != nullptr) desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.aux != nullptr) {
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.ldaux);
  }

  Layout a_layout(type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda);
  Layout b_layout(type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb);
  Layout d_layout(type, g.m, g.n, g.ldd);

  const uint32_t align_a = alignment(g.a), align_b = alignment(g.b), align_d = alignment(g.d);
  const std::string key = std::to_string(device.index()) + "/" + std::to_string(static_cast<int>(type)) + "/" +
                          std::to_string(g.trans_a) + std::to_string(g.trans_b) + "/" + std::to_string(g.m) +
                          "x" + std::to_string(g.n) + "x" + std::to_string(g.k) + "/" + std::to_string(g.lda) +
                          "," + std::to_string(g.ldb) + "," + std::to_string(g.ldd) + "/" +
                          std::to_string(static_cast<int>(g.epilogue)) + "/" + std::to_string(align_a) + "," +
                          std::to_string(align_b) + "," + std::to_string(align_d);

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulAlgo_t algo;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(algo_mutex);
    auto it = algo_cache.find(key);
    if (it != algo_cache.end()) {
      algo = it->second;
      cached = true;
    }
  }
  at::Tensor workspace = at::empty({static_cast<int64_t>(kWorkspaceBytes)},
                                   at::TensorOptions().dtype(at::kByte).device(device));
  const float alpha = 1.0f, beta = 0.0f;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  auto matmul = [&](const cublasLtMatmulAlgo_t& a) {
    return cublasLtMatmul(handle, desc.desc, &alpha, g.a, a_layout.layout, g.b, b_layout.layout, &beta, g.d,
                          d_layout.layout, g.d, d_layout.layout, &a, workspace.data_ptr(), kWorkspaceBytes, stream);
  };
  if (!cached) {
    Preference pref;
    pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(kWorkspaceBytes));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
    constexpr int kCandidates = 8;
    cublasLtMatmulHeuristicResult_t results[kCandidates];
    int found = 0;
    check_lt(cublasLtMatmulAlgoGetHeuristic(handle, desc.desc, a_layout.layout, b_layout.layout, d_layout.layout,
                                            d_layout.layout, pref.pref, kCandidates, results, &found),
             "MatmulAlgoGetHeuristic");
    TORCH_CHECK(found > 0, "flash dense (cuBLASLt): no algorithm for ", key);
    algo = results[0].algo;
    // The heuristic's first pick is not always the fastest with an epilogue (the bias-gradient ones on
    // long-K, small-output GEMMs especially), and configurations it does not offer can be faster still
    // (kExtraConfigs): time them all once per problem and keep the best. Not while a CUDA graph is being
    // captured: there the first pick is used (and not cached).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusNone) {
      std::vector<cublasLtMatmulAlgo_t> candidates;
      for (int i = 0; i < found; ++i) candidates.push_back(results[i].algo);
      for (const auto& extra : extra_candidates(handle, desc.desc, a_layout.layout, b_layout.layout,
                                                d_layout.layout, candidates))
        candidates.push_back(extra);
      int64_t forced = -1;
      {
        std::lock_guard<std::mutex> lock(algo_mutex);
        forced = forced_candidate;
      }
      if (forced >= 0) {
        TORCH_CHECK(forced < static_cast<int64_t>(candidates.size()), "flash dense (cuBLASLt): forced candidate ",
                    forced, " but problem ", key, " has ", candidates.size());
        algo = candidates[forced];
      } else if (candidates.size() > 1) {
        std::vector<float> best_ms;
        const int best = fastest_candidate(candidates, matmul, stream, best_ms);
        algo = candidates[best];
        std::string pick = key + ": candidate " + std::to_string(best) + " of " +
                           std::to_string(candidates.size()) + " (" + describe_algo(algo) + "), heuristic " +
                           std::to_string(found) + ", us";
        for (float ms : best_ms) pick += " " + (ms < 0.0f ? std::string("fail") : std::to_string(ms * 1e3f));
        std::lock_guard<std::mutex> lock(algo_mutex);
        algo_picks.push_back(pick);
      }
    }
    if (capture == cudaStreamCaptureStatusNone) {
      std::lock_guard<std::mutex> lock(algo_mutex);
      algo_cache.emplace(key, algo);
    }
  }
  check_lt(matmul(algo), "Matmul");
}

void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.is_contiguous(), "flash dense (cuBLASLt): ", name,
              " must be a contiguous 2-D CUDA tensor, got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, "flash dense (cuBLASLt): ", name,
              " must be float16 or bfloat16, got ", t.scalar_type());
}

// out = x @ weight.T + bias, optionally followed by tanh-GELU, with the pre-activation kept in `pre` when
// `store_pre` (training); inference skips that (M, N) store.
std::tuple<at::Tensor, at::Tensor> linear_epilogue(const at::Tensor& x, const at::Tensor& weight,
                                                    const std::optional<at::Tensor>& bias, bool gelu_tanh,
                                                    bool store_pre) {
  check_2d(x, "x");
  check_2d(weight, "weight");
  TORCH_CHECK(x.size(1) == weight.size(1), "flash dense (cuBLASLt): x and weight disagree on K");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor pre = gelu_tanh && store_pre ? at::empty({M, N}, x.options()) : at::empty({0}, x.options());
  if (M == 0) return {out, pre};

  LtGemm g;
  // D^T (N, M) = W (N, K) @ x^T (K, M): A is the row-major weight read transposed, B the row-major x.
  g.trans_a = true;
  g.m = N;
  g.n = M;
  g.k = K;
  g.a = weight.data_ptr();
  g.lda = K;
  g.b = x.data_ptr();
  g.ldb = K;
  g.d = out.data_ptr();
  g.ldd = N;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == N &&
                    bias->scalar_type() == x.scalar_type(),
                "flash dense (cuBLASLt): bias must be a contiguous (N,) tensor of x's dtype");
    g.bias = bias->data_ptr();
  }
  if (gelu_tanh && store_pre) {
    g.epilogue = has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    g.aux = pre.data_ptr();
    g.ldaux = N;
  } else if (gelu_tanh) {
    g.epilogue = has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
  } else {
    g.epilogue = has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  }
  run_gemm(g, x.scalar_type(), x.device());
  return {out, pre};
}

std::tuple<at::Tensor, at::Tensor> cublaslt_linear_gelu_tanh(const at::Tensor& x, const at::Tensor& weight,
                                                             const std::optional<at::Tensor>& bias,
                                                             bool store_pre) {
  return linear_epilogue(x, weight, bias, /*gelu_tanh=*/true, store_pre);
}

at::Tensor cublaslt_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return std::get<0>(linear_epilogue(x, weight, bias, /*gelu_tanh=*/false, /*store_pre=*/false));
}

// grad_weight = grad.T @ x, and, where `grad_bias` is defined, grad_bias = grad.sum(0) by the GEMM's BGRADB
// epilogue.
at::Tensor linear_wgrad(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& grad_bias) {
  check_2d(grad, "grad");
  check_2d(x, "x");
  TORCH_CHECK(grad.size(0) == x.size(0) && grad.scalar_type() == x.scalar_type(),
              "flash dense (cuBLASLt): grad and x disagree on M or dtype");
  const int64_t M = x.size(0), K = x.size(1), N = grad.size(1);
  c10::cuda::CUDAGuard guard(x.device());
  if (M == 0) {
    if (grad_bias.defined()) grad_bias.zero_();
    return at::zeros({N, K}, x.options());
  }
  at::Tensor grad_weight = at::empty({N, K}, x.options());
  LtGemm g;
  // dW^T (K, N) = x^T (K, M) @ grad (M, N); the bias gradient reduces op(B) over the GEMM's k (= M).
  g.trans_b = true;
  g.m = K;
  g.n = N;
  g.k = M;
  g.a = x.data_ptr();
  g.lda = K;
  g.b = grad.data_ptr();
  g.ldb = N;
  g.d = grad_weight.data_ptr();
  g.ldd = K;
  if (grad_bias.defined()) {
    g.epilogue = CUBLASLT_EPILOGUE_BGRADB;
    g.bias = grad_bias.data_ptr();
  }
  run_gemm(g, x.scalar_type(), x.device());
  return grad_weight;
}

std::tuple<at::Tensor, at::Tensor> cublaslt_linear_wgrad_bgrad(const at::Tensor& grad, const at::Tensor& x) {
  at::Tensor grad_bias = at::empty({grad.size(1)}, grad.options());
  at::Tensor grad_weight = linear_wgrad(grad, x, grad_bias);
  return {grad_weight, grad_bias};
}

// grad_weight = grad.T @ x alone: aten's mm runs the same GEMM, but through cuBLAS's own choice, which measured
// 2-10 % slower than the fastest of run_gemm's candidates at bench_dense's weight gradients (H200;
// bench/logs/dense_gemm_replay_probe_*_h200.log).
at::Tensor cublaslt_linear_wgrad(const at::Tensor& grad, const at::Tensor& x) {
  return linear_wgrad(grad, x, at::Tensor());
}

// For a Linear -> tanh-GELU -> Linear chain: the second Linear's input gradient (grad @ weight) times
// GELU'(pre), and its column sums (the first Linear's bias gradient), all in one GEMM (DGELU_BGRAD).
// cuBLASLt applies GELU' to the GEMM's own output, so a lone Linear+GELU has no GEMM to hang it on.
std::tuple<at::Tensor, at::Tensor> cublaslt_linear_dgrad_dgelu_bgrad(const at::Tensor& grad,
                                                                     const at::Tensor& weight,
                                                                     const at::Tensor& pre) {
  check_2d(grad, "grad");
  check_2d(weight, "weight");
  check_2d(pre, "pre");
  const int64_t M = grad.size(0), N = grad.size(1), H = weight.size(1);
  TORCH_CHECK(weight.size(0) == N && pre.size(0) == M && pre.size(1) == H,
              "flash dense (cuBLASLt): grad (M, N), weight (N, H) and pre (M, H) disagree");
  c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor grad_pre = at::empty({M, H}, grad.options());
  at::Tensor grad_bias = at::empty({H}, grad.options());
  if (M == 0) return {grad_pre, grad_bias.zero_()};
  LtGemm g;
  // dpre^T (H, M) = W^T (H, N) @ grad^T (N, M); the bias gradient sums D's rows.
  g.m = H;
  g.n = M;
  g.k = N;
  g.a = weight.data_ptr();
  g.lda = H;
  g.b = grad.data_ptr();
  g.ldb = N;
  g.d = grad_pre.data_ptr();
  g.ldd = H;
  g.epilogue = CUBLASLT_EPILOGUE_DGELU_BGRAD;
  g.bias = grad_bias.data_ptr();
  g.aux = const_cast<void*>(pre.data_ptr());
  g.ldaux = H;
  run_gemm(g, grad.scalar_type(), grad.device());
  return {grad_pre, grad_bias};
}

// The picks recorded by run_gemm, oldest first (flash::cublaslt_algo_picks).
std::vector<std::string> cublaslt_algo_picks() {
  std::lock_guard<std::mutex> lock(algo_mutex);
  return algo_picks;
}

// Sets forced_candidate (see there) and forgets every cached choice, so that the next call of each problem
// chooses again: under the forced index, or by timing once it is -1 again.
void cublaslt_force_candidate(int64_t index) {
  std::lock_guard<std::mutex> lock(algo_mutex);
  forced_candidate = index;
  algo_cache.clear();
}

}  // namespace

// A fragment: other csrc files register their own ops in the same `flash` namespace.
TORCH_LIBRARY_FRAGMENT(flash, m) {
  m.def(
      "cublaslt_linear_gelu_tanh(Tensor x, Tensor weight, Tensor? bias, bool store_pre) -> "
      "(Tensor out, Tensor pre)");
  m.def("cublaslt_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("cublaslt_linear_wgrad_bgrad(Tensor grad, Tensor x) -> (Tensor grad_weight, Tensor grad_bias)");
  m.def("cublaslt_linear_wgrad(Tensor grad, Tensor x) -> Tensor grad_weight");
  m.def(
      "cublaslt_linear_dgrad_dgelu_bgrad(Tensor grad, Tensor weight, Tensor pre) -> "
      "(Tensor grad_pre, Tensor grad_bias)");
  // No tensor arguments: a catch-all kernel, for every device.
  m.def("cublaslt_algo_picks() -> str[]", &cublaslt_algo_picks);
  m.def("cublaslt_force_candidate(int index) -> ()", &cublaslt_force_candidate);
}

TORCH_LIBRARY_IMPL(flash, CUDA, m) {
  m.impl("cublaslt_linear_gelu_tanh", &cublaslt_linear_gelu_tanh);
  m.impl("cublaslt_linear", &cublaslt_linear);
  m.impl("cublaslt_linear_wgrad_bgrad", &cublaslt_linear_wgrad_bgrad);
  m.impl("cublaslt_linear_wgrad", &cublaslt_linear_wgrad);
  m.impl("cublaslt_linear_dgrad_dgelu_bgrad", &cublaslt_linear_dgrad_dgelu_bgrad);
}
