// Python bindings: check the tensors, fill the launch parameters, launch on PyTorch's current
// stream, and raise (TORCH_CHECK) naming the kernel if a launch fails.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "common.cuh"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// PyTorch's current stream on the current device (what at::cuda::getCurrentCUDAStream returns;
// this header needs no CUDA math libraries).
cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Numbers, sizes, dtypes and devices as text for error messages. TORCH_CHECK streams its
// arguments into an ostream built in this extension; on the GPU machines streaming a number
// there crashed the process (SIGSEGV in the locale's number formatting), streaming text did
// not.
std::string text(int64_t v) { return std::to_string(v); }
std::string text(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}
std::string text(at::ScalarType t) { return c10::toString(t); }
std::string text(const at::Device& d) { return d.str(); }

// Raises naming the kernel if its launch failed, after clearing the runtime's record of the
// error (else the next launch's check would report it again).
void check_launch(const lbw::LaunchResult& result) {
  if (result.error != cudaSuccess) (void)cudaGetLastError();
  TORCH_CHECK(result.error == cudaSuccess, "layerbench wmma: ", result.kernel, " failed: ",
              cudaGetErrorString(result.error));
}

void check(const Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", text(dtype), ", got ",
              text(t.scalar_type()));
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Operands the kernels copy in 16-byte pieces.
void check_aligned(const Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              name, " must be 16-byte aligned");
}

void check_rows(const Tensor& t, int64_t rows, int64_t cols, at::ScalarType dtype,
                const char* name) {
  check(t, dtype, name);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must be [",
              text(rows), ", ", text(cols), "], got ", text(t.sizes()));
}

// Every tensor given (a name each) on one device: the kernels launch on the first's.
void check_one_device(std::initializer_list<std::pair<OptTensor, const char*>> tensors) {
  std::optional<at::Device> device;
  const char* first = nullptr;
  for (const auto& [t, name] : tensors) {
    if (!t) continue;
    if (!device) {
      device = t->device();
      first = name;
    }
    TORCH_CHECK(t->device() == *device, name, " is on ", text(t->device()), " and ", first,
                " on ", text(*device), ": every tensor must be on one device");
  }
}

lbw::DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return lbw::DType::kFloat32;
    case at::kHalf: return lbw::DType::kFloat16;
    case at::kBFloat16: return lbw::DType::kBFloat16;
    default: break;
  }
  TORCH_CHECK(false, "unsupported dtype ", text(t.scalar_type()));
  return lbw::DType::kFloat32;
}

template <typename T>
T* ptr(const OptTensor& t) {
  return t.has_value() ? reinterpret_cast<T*>(t->data_ptr()) : nullptr;
}

// hi (and lo) = fp16 parts of LayerNorm(x) * weight + bias; copy = fp32 x when given.
// in_registers: each warp holds its row in registers (where the row and pointers allow).
void norm_split(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& hi,
                const OptTensor& lo, const OptTensor& copy, double eps, bool in_registers) {
  const int64_t rows = x.size(0), cols = x.size(1);
  check_rows(x, rows, cols, x.scalar_type(), "x");
  check_rows(weight.view({1, cols}), 1, cols, at::kFloat, "weight");
  check_rows(bias.view({1, cols}), 1, cols, at::kFloat, "bias");
  check_rows(hi, rows, cols, at::kHalf, "hi");
  if (lo) check_rows(*lo, rows, cols, at::kHalf, "lo");
  if (copy) check_rows(*copy, rows, cols, at::kFloat, "copy");
  check_one_device({{x, "x"}, {weight, "weight"}, {bias, "bias"}, {hi, "hi"}, {lo, "lo"},
                    {copy, "copy"}});
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  lbw::NormSplitParams p{x.data_ptr(), dtype_of(x), weight.data_ptr<float>(),
                         bias.data_ptr<float>(), reinterpret_cast<__half*>(hi.data_ptr()),
                         ptr<__half>(lo), ptr<float>(copy), rows, static_cast<int>(cols),
                         static_cast<float>(eps), in_registers};
  check_launch(lbw::launch_norm_split(p, current_stream()));
}

// out = LayerNorm(x) * weight + bias in out's dtype; rows with valid 0 are 0.
void norm_out(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
              const OptTensor& valid, double eps) {
  const int64_t rows = x.size(0), cols = x.size(1);
  check_rows(x, rows, cols, at::kFloat, "x");
  check_rows(weight.view({1, cols}), 1, cols, at::kFloat, "weight");
  check_rows(bias.view({1, cols}), 1, cols, at::kFloat, "bias");
  check_rows(out, rows, cols, out.scalar_type(), "out");
  if (valid) check_rows(valid->view({rows, 1}), rows, 1, at::kByte, "valid");
  check_one_device({{x, "x"}, {weight, "weight"}, {bias, "bias"}, {out, "out"},
                    {valid, "valid"}});
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  lbw::NormOutParams p{x.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(),
                       out.data_ptr(), dtype_of(out), ptr<uint8_t>(valid), rows,
                       static_cast<int>(cols), static_cast<float>(eps)};
  check_launch(lbw::launch_norm_out(p, current_stream()));
}

// out = epilogue(a @ w^T + bias): three products with both lo parts (fp16x3), two with a_lo
// only (a_lo*w_hi + a_hi*w_hi), one with the hi parts only. With norm_w (residual epilogues,
// stream tiles whose columns hold N): norm_out (and norm_lo) = LayerNorm of each written row
// (fp16 norm_out: its hi part, norm_lo the lo part; else norm_out's dtype), rows with valid 0
// written as 0 if norm_zero_invalid; out_f32 may then be None.
void linear(const Tensor& a_hi, const OptTensor& a_lo, const Tensor& w_hi,
            const OptTensor& w_lo, const Tensor& bias, int64_t epilogue,
            const OptTensor& residual, const OptTensor& valid, const OptTensor& out_f32,
            const OptTensor& out_hi, const OptTensor& out_lo, int64_t tile,
            const OptTensor& norm_w, const OptTensor& norm_b, const OptTensor& norm_out,
            const OptTensor& norm_lo, bool norm_zero_invalid, double eps) {
  const int64_t m = a_hi.size(0), k = a_hi.size(1), n = w_hi.size(0);
  const int products = a_lo.has_value() ? (w_lo.has_value() ? 3 : 2) : 1;
  TORCH_CHECK(a_lo.has_value() || !w_lo.has_value(), "w_lo needs a_lo (three products)");
  TORCH_CHECK(k % 8 == 0, "the inner dimension must be a multiple of 8, got ", text(k));
  check_rows(a_hi, m, k, at::kHalf, "a_hi");
  check_rows(w_hi, n, k, at::kHalf, "w_hi");
  check_aligned(a_hi, "a_hi");
  check_aligned(w_hi, "w_hi");
  if (a_lo) {
    check_rows(*a_lo, m, k, at::kHalf, "a_lo");
    check_aligned(*a_lo, "a_lo");
  }
  if (w_lo) {
    check_rows(*w_lo, n, k, at::kHalf, "w_lo");
    check_aligned(*w_lo, "w_lo");
  }
  check_rows(bias.view({1, n}), 1, n, at::kFloat, "bias");
  const auto kind = static_cast<lbw::Epilogue>(epilogue);
  const bool residual_epilogue =
      kind == lbw::Epilogue::kResidualUpdate || kind == lbw::Epilogue::kResidualSum;
  TORCH_CHECK(epilogue >= 0 && epilogue <= 3, "unknown epilogue ", text(epilogue));
  const bool norm = norm_w.has_value();
  TORCH_CHECK(norm == norm_b.has_value() && norm == norm_out.has_value() &&
                  (norm || !norm_lo.has_value()),
              "norm_w, norm_b and norm_out come together (norm_lo only with them)");
  TORCH_CHECK(!norm || residual_epilogue, "the norm epilogue needs a residual epilogue");
  if (residual_epilogue) {
    TORCH_CHECK(residual && (out_f32 || norm),
                "residual epilogues need residual and out_f32 (or a norm)");
    check_rows(*residual, m, n, at::kFloat, "residual");
    if (out_f32) check_rows(*out_f32, m, n, at::kFloat, "out_f32");
  } else {
    TORCH_CHECK(out_hi, "this epilogue needs out_hi");
    check_rows(*out_hi, m, n, at::kHalf, "out_hi");
  }
  if (kind == lbw::Epilogue::kGeluPair) {
    TORCH_CHECK(out_lo, "the GELU epilogue needs out_lo");
    check_rows(*out_lo, m, n, at::kHalf, "out_lo");
  }
  if (valid) check_rows(valid->view({m, 1}), m, 1, at::kByte, "valid");
  if (norm) {
    check_rows(norm_w->view({1, n}), 1, n, at::kFloat, "norm_w");
    check_rows(norm_b->view({1, n}), 1, n, at::kFloat, "norm_b");
    check_rows(*norm_out, m, n, norm_out->scalar_type(), "norm_out");
    (void)dtype_of(*norm_out);  // fp32, fp16 or bf16
    if (norm_lo) {
      TORCH_CHECK(norm_out->scalar_type() == at::kHalf, "norm_lo needs an fp16 norm_out");
      check_rows(*norm_lo, m, n, at::kHalf, "norm_lo");
    }
  }
  TORCH_CHECK(tile >= 0 && tile < lbw::kGemmTiles, "unknown tile ", text(tile));
  check_one_device({{a_hi, "a_hi"}, {a_lo, "a_lo"}, {w_hi, "w_hi"}, {w_lo, "w_lo"},
                    {bias, "bias"}, {residual, "residual"}, {valid, "valid"},
                    {out_f32, "out_f32"}, {out_hi, "out_hi"}, {out_lo, "out_lo"},
                    {norm_w, "norm_w"}, {norm_b, "norm_b"}, {norm_out, "norm_out"},
                    {norm_lo, "norm_lo"}});
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(a_hi.device());
  lbw::LinearParams p{reinterpret_cast<const __half*>(a_hi.data_ptr()), ptr<const __half>(a_lo),
                      reinterpret_cast<const __half*>(w_hi.data_ptr()), ptr<const __half>(w_lo),
                      bias.data_ptr<float>(), ptr<const float>(residual), ptr<uint8_t>(valid),
                      ptr<float>(out_f32), ptr<__half>(out_hi), ptr<__half>(out_lo), m,
                      static_cast<int>(n), static_cast<int>(k)};
  lbw::LinearNormParams q{};
  if (norm) {
    q = lbw::LinearNormParams{norm_w->data_ptr<float>(), norm_b->data_ptr<float>(),
                              norm_out->data_ptr(), ptr<__half>(norm_lo), dtype_of(*norm_out),
                              norm_zero_invalid ? 1 : 0, static_cast<float>(eps)};
  }
  check_launch(lbw::launch_linear(p, static_cast<lbw::GemmTile>(tile), products, kind,
                                  current_stream(), norm ? &q : nullptr));
}

// (ctx_hi, ctx_lo) = fp16 parts of softmax(q k^T / sqrt(head_dim)) v for every head.
void attention(const Tensor& qkv, const Tensor& ctx_hi, const Tensor& ctx_lo,
               const OptTensor& valid, int64_t batch, int64_t seq_len, int64_t heads,
               bool causal, int64_t block_n, int64_t variant) {
  TORCH_CHECK(batch >= 0 && seq_len >= 0 && heads > 0, "batch, seq_len and heads must be at "
              "least 0, 0 and 1, got ", text(batch), ", ", text(seq_len), ", ", text(heads));
  const int64_t rows = batch * seq_len, d_model = ctx_hi.size(1);
  const int64_t head_dim = d_model / heads;
  TORCH_CHECK(d_model % heads == 0 && head_dim % 8 == 0 && head_dim <= 256,
              "head dims must be a multiple of 8 up to 256, got ", text(head_dim));
  TORCH_CHECK(variant >= 0 || ((seq_len + 63) / 64 <= 65535 && batch * heads <= 0x7fffffff),
              "seq_len ", text(seq_len), " or batch * heads ", text(batch * heads),
              " is too large for the legacy kernel's grid");
  TORCH_CHECK(variant < lbw::attention_variant_count(), "unknown attention variant ",
              text(variant));
  check_rows(qkv, rows, 3 * d_model, at::kHalf, "qkv");
  check_aligned(qkv, "qkv");
  check_rows(ctx_hi, rows, d_model, at::kHalf, "ctx_hi");
  check_rows(ctx_lo, rows, d_model, at::kHalf, "ctx_lo");
  if (variant >= 0) {  // the flash kernels store two halves at a time
    TORCH_CHECK(reinterpret_cast<uintptr_t>(ctx_hi.data_ptr()) % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(ctx_lo.data_ptr()) % 4 == 0,
                "ctx_hi and ctx_lo must be 4-byte aligned");
  }
  if (valid) check_rows(valid->view({rows, 1}), rows, 1, at::kByte, "valid");
  check_one_device({{qkv, "qkv"}, {ctx_hi, "ctx_hi"}, {ctx_lo, "ctx_lo"}, {valid, "valid"}});
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(qkv.device());
  const int head_pad = static_cast<int>((head_dim + 15) / 16 * 16);
  lbw::AttentionParams p{reinterpret_cast<const __half*>(qkv.data_ptr()),
                         reinterpret_cast<__half*>(ctx_hi.data_ptr()),
                         reinterpret_cast<__half*>(ctx_lo.data_ptr()), ptr<uint8_t>(valid),
                         static_cast<int>(batch), static_cast<int>(seq_len),
                         static_cast<int>(heads), static_cast<int>(head_dim), head_pad,
                         causal ? 1 : 0,
                         static_cast<float>(1.4426950408889634 / std::sqrt(double(head_dim)))};
  check_launch(variant >= 0
                   ? lbw::launch_flash_attention(p, static_cast<int>(variant), current_stream())
                   : lbw::launch_attention(p, static_cast<int>(block_n), current_stream()));
}

// The flash variants' names, in index order.
std::vector<std::string> attention_variants() {
  std::vector<std::string> names;
  for (int i = 0; i < lbw::attention_variant_count(); ++i) {
    names.emplace_back(lbw::attention_variant_name(i));
  }
  return names;
}

// (kernel name, head_pad, block_m, block_n, threads, shared bytes) of the instance a variant
// runs for head_pad; the name is empty if there is none.
std::tuple<std::string, int, int, int, int, int> attention_instance(int64_t variant,
                                                                     int64_t head_pad) {
  const lbw::AttentionInstanceInfo i =
      lbw::attention_instance(static_cast<int>(variant), static_cast<int>(head_pad));
  return {i.name ? i.name : "", i.head_pad, i.block_m, i.block_n, i.threads, i.smem_bytes};
}

// Mismatch counts of the fragment-layout probe on the current device (all 0: the flash
// kernels' layout assumption holds there); synchronises.
std::vector<int64_t> attention_layout_mismatches() {
  const Tensor out = torch::full({4}, -1, torch::dtype(torch::kInt32).device(torch::kCUDA));
  const c10::cuda::CUDAGuard guard(out.device());
  check_launch(lbw::launch_attention_layout_probe(out.data_ptr<int>(), current_stream()));
  const Tensor host = out.cpu();
  return {host[0].item<int64_t>(), host[1].item<int64_t>(), host[2].item<int64_t>(),
          host[3].item<int64_t>()};
}

// out = LayerNorm(x) @ w^T + bias (fp16, one product); copy = fp32 x when given.
void norm_qkv(const Tensor& x, const Tensor& norm_w, const Tensor& norm_b, const Tensor& w,
              const Tensor& bias, const Tensor& out, const OptTensor& copy, double eps) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % 8 == 0 && k <= 256, "norm_qkv takes d_model a multiple of 8 up to 256, got ",
              text(k));
  check_rows(x, m, k, x.scalar_type(), "x");
  check_rows(norm_w.view({1, k}), 1, k, at::kFloat, "norm_w");
  check_rows(norm_b.view({1, k}), 1, k, at::kFloat, "norm_b");
  check_rows(w, n, k, at::kHalf, "w");
  check_aligned(w, "w");
  check_rows(bias.view({1, n}), 1, n, at::kFloat, "bias");
  check_rows(out, m, n, at::kHalf, "out");
  if (copy) check_rows(*copy, m, k, at::kFloat, "copy");
  check_one_device({{x, "x"}, {norm_w, "norm_w"}, {norm_b, "norm_b"}, {w, "w"}, {bias, "bias"},
                    {out, "out"}, {copy, "copy"}});
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  lbw::NormQkvParams p{x.data_ptr(), dtype_of(x), norm_w.data_ptr<float>(),
                       norm_b.data_ptr<float>(), reinterpret_cast<const __half*>(w.data_ptr()),
                       bias.data_ptr<float>(), reinterpret_cast<__half*>(out.data_ptr()),
                       ptr<float>(copy), m, static_cast<int>(n), static_cast<int>(k),
                       static_cast<float>(eps)};
  check_launch(lbw::launch_norm_qkv(p, current_stream()));
}

const __half* half_ptr(const Tensor& t) { return reinterpret_cast<const __half*>(t.data_ptr()); }

// out_rows = the block's output rows from the attention context (see FfnBlockParams); with
// norm_w/norm_b, normed = their LayerNorm (any float dtype; zero_invalid: invalid rows 0).
// One fp16 product without ctx_lo, two with it.
void ffn_block(const Tensor& ctx_hi, const OptTensor& ctx_lo, const Tensor& residual,
               const OptTensor& out_rows, const OptTensor& valid, const Tensor& wo,
               const Tensor& bo, const Tensor& n2_w, const Tensor& n2_b, const Tensor& wi,
               const Tensor& bi, const Tensor& wf, const Tensor& bf, const OptTensor& norm_w,
               const OptTensor& norm_b, const OptTensor& normed, bool zero_invalid,
               double eps) {
  const int64_t m = ctx_hi.size(0), d = ctx_hi.size(1), f = wi.size(0);
  TORCH_CHECK(d % 8 == 0 && f % 8 == 0 && d <= 128 && f <= 128,
              "ffn_block takes d_model and ffn_dim multiples of 8 up to 128, got ", text(d), ", ",
              text(f));
  const bool norm = norm_w.has_value();
  TORCH_CHECK(norm == norm_b.has_value() && norm == normed.has_value(),
              "norm_w, norm_b and normed come together");
  TORCH_CHECK(out_rows || norm, "ffn_block needs out_rows, normed or both");
  const Tensor* halves[] = {&ctx_hi, &wo, &wi, &wf};
  const int64_t rows[] = {m, d, f, d};
  const int64_t cols[] = {d, d, d, f};
  const char* names[] = {"ctx_hi", "wo", "wi", "wf"};
  for (int i = 0; i < 4; ++i) {
    check_rows(*halves[i], rows[i], cols[i], at::kHalf, names[i]);
    check_aligned(*halves[i], names[i]);
  }
  if (ctx_lo) {
    check_rows(*ctx_lo, m, d, at::kHalf, "ctx_lo");
    check_aligned(*ctx_lo, "ctx_lo");
  }
  check_rows(residual, m, d, at::kFloat, "residual");
  check_aligned(residual, "residual");
  if (out_rows) check_rows(*out_rows, m, d, at::kFloat, "out_rows");
  if (valid) check_rows(valid->view({m, 1}), m, 1, at::kByte, "valid");
  const Tensor* vectors[] = {&bo, &n2_w, &n2_b, &bf};
  for (const Tensor* v : vectors) check_rows(v->view({1, d}), 1, d, at::kFloat, "vector");
  check_rows(bi.view({1, f}), 1, f, at::kFloat, "bi");
  if (norm) {
    check_rows(norm_w->view({1, d}), 1, d, at::kFloat, "norm_w");
    check_rows(norm_b->view({1, d}), 1, d, at::kFloat, "norm_b");
    check_rows(*normed, m, d, normed->scalar_type(), "normed");
  }
  check_one_device({{ctx_hi, "ctx_hi"}, {ctx_lo, "ctx_lo"}, {residual, "residual"},
                    {out_rows, "out_rows"}, {valid, "valid"}, {wo, "wo"}, {bo, "bo"},
                    {n2_w, "n2_w"}, {n2_b, "n2_b"}, {wi, "wi"}, {bi, "bi"}, {wf, "wf"},
                    {bf, "bf"}, {norm_w, "norm_w"}, {norm_b, "norm_b"}, {normed, "normed"}});
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(ctx_hi.device());
  lbw::FfnBlockParams p{half_ptr(ctx_hi), ptr<const __half>(ctx_lo), residual.data_ptr<float>(),
                        ptr<uint8_t>(valid), half_ptr(wo), bo.data_ptr<float>(),
                        n2_w.data_ptr<float>(), n2_b.data_ptr<float>(), half_ptr(wi),
                        bi.data_ptr<float>(), half_ptr(wf), bf.data_ptr<float>(),
                        ptr<float>(out_rows), ptr<const float>(norm_w), ptr<const float>(norm_b),
                        norm ? normed->data_ptr() : nullptr,
                        norm ? dtype_of(*normed) : lbw::DType::kFloat32, zero_invalid, m,
                        static_cast<int>(d), static_cast<int>(f), static_cast<float>(eps)};
  check_launch(lbw::launch_ffn_block(p, current_stream()));
}

// The wmma ceiling kernel (peak.cu) into out (fp32, at least blocks * threads elements).
void mma_peak(const Tensor& out, int64_t blocks, int64_t threads, int64_t iters) {
  check(out, at::kFloat, "out");
  TORCH_CHECK(blocks >= 1 && blocks <= 65535 * 64, "blocks must be in 1..4194240, got ",
              text(blocks));
  TORCH_CHECK(threads >= 32 && threads <= 1024 && threads % 32 == 0,
              "threads must be a multiple of 32 in 32..1024, got ", text(threads));
  TORCH_CHECK(iters >= 1 && iters <= (1 << 30), "iters must be in 1..2^30, got ", text(iters));
  TORCH_CHECK(out.numel() >= blocks * threads, "out must hold blocks * threads elements");
  const c10::cuda::CUDAGuard guard(out.device());
  check_launch(lbw::launch_mma_peak(out.data_ptr<float>(), static_cast<int>(blocks),
                                    static_cast<int>(threads), static_cast<int>(iters),
                                    current_stream()));
}

// This thread's programmatic launch setting (lbw::programmatic_launches).
thread_local bool programmatic = false;

// Sets it; returns the previous value.
bool set_programmatic_launches(bool on) {
  const bool previous = programmatic;
  programmatic = on;
  return previous;
}

}  // namespace

namespace lbw {
bool programmatic_launches() { return programmatic; }
}  // namespace lbw

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "layerbench wmma kernels";
  m.def("norm_split", &norm_split, "LayerNorm rows into an fp16 (hi, lo) pair");
  m.def("norm_out", &norm_out, "final LayerNorm into the output dtype, invalid rows zero");
  m.def("linear", &linear, "a @ w^T + bias with an epilogue (and a row LayerNorm), on wmma",
        py::arg("a_hi"), py::arg("a_lo"), py::arg("w_hi"), py::arg("w_lo"), py::arg("bias"),
        py::arg("epilogue"), py::arg("residual"), py::arg("valid"), py::arg("out_f32"),
        py::arg("out_hi"), py::arg("out_lo"), py::arg("tile"), py::arg("norm_w") = py::none(),
        py::arg("norm_b") = py::none(), py::arg("norm_out") = py::none(),
        py::arg("norm_lo") = py::none(), py::arg("norm_zero_invalid") = false,
        py::arg("eps") = 1e-5);
  m.def("attention", &attention, "causal or full flash attention, context as an fp16 pair");
  m.def("attention_smem_bytes", &lbw::attention_smem_bytes,
        "dynamic shared memory of one attention block");
  m.def("attention_variants", &attention_variants, "names of the flash attention variants");
  m.def("attention_instance", &attention_instance,
        "(kernel, head_pad, block_m, block_n, threads, shared bytes) of a variant's instance");
  m.def("attention_layout_mismatches", &attention_layout_mismatches,
        "mismatch counts of the wmma fragment-layout probe on the current device");
  m.def("norm_qkv", &norm_qkv, "norm1 fused into the Q/K/V GEMM (d_model up to 256)");
  m.def("ffn_block", &ffn_block,
        "out_proj, residual, norm2, FFN, residual (and a norm of the output rows) for whole rows");
  m.def("ffn_block_smem_bytes", &lbw::ffn_block_smem_bytes,
        "dynamic shared memory of one ffn_block block");
  m.def("set_programmatic_launches", &set_programmatic_launches,
        "launch the forward kernels of this thread as programmatic dependents (sm_90 on); "
        "returns the previous setting");
  m.def("mma_peak", &mma_peak, "register-resident wmma products only: the device's ceiling");
  m.def("mma_peak_chains", []() { return lbw::kPeakChains; },
        "independent accumulators per warp in mma_peak");
}
