// The forward pass of the llama, qwen2 and qwen3 dense families over a KV cache held in
// share_layout tensors. Follows llama.cpp's graph (src/models/{llama,qwen2,qwen3}.cpp,
// llm_graph_context::build_attn, build_norm, build_ffn) and ggml-cpu's arithmetic where
// it decides rounding (ops.cpp: rms_norm sums in double, rope caches sin/cos per
// position, softmax exponentiates in float). Matrix products run through OpenBLAS.
#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "refmodel/model_impl.h"
#include "refmodel/quant.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace kvshare::refmodel {
namespace {

using layout::GgmlType;

// Tokens per forward step: bounds the score matrices (n_ubatch x n_kv per head), as
// llama.cpp's -ub does.
constexpr int kUbatch = 512;
// Query rows per block of the attention: bounds the scores of a whole-prompt prefill to
// kAttnRows x n_kv (64 MiB at 32768 cells). kUbatch, so a decode step is one block and
// computes as it did before the blocks.
constexpr int64_t kAttnRows = kUbatch;

// y[n][rows] = x[n][cols] * W^T, with x rounded as ggml-cpu rounds the right-hand side
// for W's type first.
void matmul(const Matrix& w, const float* x, int64_t n, float* y, std::vector<float>& scratch) {
  const float* in = x;
  if (w.type != GgmlType::F32) {
    scratch.assign(x, x + n * w.cols);
    for (int64_t i = 0; i < n; ++i) round_like_vec_dot(w.type, scratch.data() + i * w.cols, w.cols);
    in = scratch.data();
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), static_cast<int>(w.rows),
              static_cast<int>(w.cols), 1.0f, in, static_cast<int>(w.cols), w.data.data(), static_cast<int>(w.cols),
              0.0f, y, static_cast<int>(w.rows));
}

// ggml_compute_forward_rms_norm_f32 then ggml_mul by the weight.
void rms_norm(const float* x, const std::vector<float>& weight, int64_t n, float eps, float* y) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i] * x[i]);
  const float mean = static_cast<float>(sum / static_cast<double>(n));
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * scale) * weight[static_cast<size_t>(i)];
}

struct LayerTensors {
  std::byte* k = nullptr;
  std::byte* v = nullptr;
};

class RefContext final : public Context {
 public:
  RefContext(std::shared_ptr<const Model> model, const LoadedModel& loaded, KvMemory kv)
      : model_(std::move(model)), m_(loaded), hp_(loaded.hparams()), kv_(std::move(kv)) {}

  Result<void> init() {
    const auto& mem = kv_.memory;
    if (mem.kind != layout::MemoryKind::kv || mem.kv_caches.size() != 1)
      return fail(EINVAL, "KV memory of kind {} with {} caches: the reference transformer needs one plain KV cache",
                  layout::memory_kind_name(mem.kind), mem.kv_caches.size());
    const auto& cache = mem.kv_caches[0];
    if (cache.n_stream != 1)
      return fail(EINVAL, "KV cache has {} streams; the reference transformer holds one sequence (use -kvu or -np 1)",
                  cache.n_stream);
    type_k_ = cache.type_k;
    type_v_ = cache.type_v;
    v_trans_ = cache.v_trans;
    kv_size_ = cache.kv_size;
    if (!is_supported_cache_type(type_k_) || !is_supported_cache_type(type_v_))
      return fail(EINVAL, "KV cache types {}/{}: the reference transformer keeps f32, f16, bf16, q8_0 or q4_0",
                  layout::ggml_type_name(type_k_), layout::ggml_type_name(type_v_));
    if (v_trans_ && layout::is_quantized(type_v_))
      return fail(EINVAL, "a quantized V cache ({}) needs flash attention (-fa on): it cannot be transposed",
                  layout::ggml_type_name(type_v_));
    if (cache.layers.size() != hp_.n_layer)
      return fail(EINVAL, "KV cache has {} layers, the model {}", cache.layers.size(), hp_.n_layer);
    if (kv_.chunks.size() != kv_.layout.chunks.size())
      return fail(EINVAL, "KV memory has {} chunk mappings, its layout {} chunks", kv_.chunks.size(),
                  kv_.layout.chunks.size());
    for (size_t c = 0; c < kv_.chunks.size(); ++c)
      if (kv_.chunks[c].size() < kv_.layout.chunks[c].size_bytes)
        return fail(EINVAL, "KV chunk {} mapping is {} bytes, its layout says {}", c, kv_.chunks[c].size(),
                    kv_.layout.chunks[c].size_bytes);
    layers_.resize(hp_.n_layer);
    for (uint32_t il = 0; il < hp_.n_layer; ++il) {
      const auto& lc = cache.layers[il];
      if (lc.il != il || lc.n_embd_k_gqa != hp_.n_embd_k_gqa() || lc.n_embd_v_gqa != hp_.n_embd_v_gqa())
        return fail(EINVAL, "KV cache layer {}: K/V widths {}/{}, the model's are {}/{}", il, lc.n_embd_k_gqa,
                    lc.n_embd_v_gqa, hp_.n_embd_k_gqa(), hp_.n_embd_v_gqa());
      for (auto kind : {layout::TensorKind::k, layout::TensorKind::v}) {
        const layout::SharedTensor* t = kv_.layout.find(0, il, kind);
        if (t == nullptr)
          return fail(ENOENT, "KV layout has no {} tensor for layer {}", layout::tensor_kind_name(kind), il);
        if (t->chunk >= kv_.chunks.size() || t->offset + t->tensor.nbytes > kv_.chunks[t->chunk].size())
          return fail(EINVAL, "KV tensor {} ({} bytes at offset {} of chunk {}) lies outside its chunk", t->tensor.name,
                      t->tensor.nbytes, t->offset, t->chunk);
        const bool is_k = kind == layout::TensorKind::k;
        const uint64_t width =
            is_k ? hp_.n_embd_k_gqa() : (v_trans_ ? static_cast<uint64_t>(t->tensor.ne[0]) : hp_.n_embd_v_gqa());
        const GgmlType type = is_k ? type_k_ : type_v_;
        if (t->tensor.type != type ||
            t->tensor.nbytes < layout::ggml_row_size(type, static_cast<int64_t>(width)) * kv_size_)
          return fail(EINVAL, "KV tensor {}: type {} and {} bytes do not hold {} cells of {} {} elements",
                      t->tensor.name, layout::ggml_type_name(t->tensor.type), t->tensor.nbytes, kv_size_, width,
                      layout::ggml_type_name(type));
        std::byte* base = kv_.chunks[t->chunk].data() + t->offset;
        if (is_k) {
          layers_[il].k = base;
        } else {
          layers_[il].v = base;
          v_width_ = width;
        }
      }
    }
    // llama.cpp reads LLAMA_ATTN_ROT_DISABLE when it creates the cache; so do we, so a
    // reference engine started beside a llama-server sees the same setting.
    const char* rot_env = std::getenv("LLAMA_ATTN_ROT_DISABLE");
    const bool rotation_disabled = rot_env != nullptr && std::atoi(rot_env) != 0;
    rot_k_ = cache_rotation_group(true, type_k_, hp_.n_embd_head_k, rotation_disabled);
    rot_v_ = cache_rotation_group(false, type_v_, hp_.n_embd_head_v, rotation_disabled);
    return {};
  }

  Result<std::vector<float>> decode(std::span<const int32_t> tokens, int32_t pos0) override {
    return forward(tokens, pos0, nullptr, kUbatch);
  }

  Result<void> prefill(std::span<const int32_t> tokens, RowSink sink) override {
    // One pass over the whole prompt: the sink sees each layer exactly once, in ascending
    // order, which a state-file writer (K of every layer before any V) relies on.
    auto r = forward(tokens, 0, &sink, tokens.size());
    if (!r) return fail(r.error());
    return {};
  }

  const Model& model() const override { return *model_; }
  int32_t n_ctx() const override { return static_cast<int32_t>(kv_size_); }

 private:
  Result<std::vector<float>> forward(std::span<const int32_t> tokens, int32_t pos0, const RowSink* sink,
                                     size_t ubatch_tokens) {
    if (tokens.empty()) return fail(EINVAL, "no tokens to evaluate");
    if (pos0 < 0) return fail(EINVAL, "position {} is negative", pos0);
    if (static_cast<uint64_t>(pos0) + tokens.size() > kv_size_)
      return fail(ENOSPC, "{} tokens at position {} exceed the context of {} cells", tokens.size(), pos0, kv_size_);
    for (size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= hp_.n_vocab)
        return fail(EINVAL, "token {} (index {}) is outside the vocabulary of {} tokens", tokens[i], i, hp_.n_vocab);
    std::vector<float> last(hp_.n_embd);
    for (size_t at = 0; at < tokens.size(); at += ubatch_tokens) {
      const size_t n = std::min<size_t>(ubatch_tokens, tokens.size() - at);
      auto ok = ubatch(tokens.data() + at, static_cast<int64_t>(n), pos0 + static_cast<int32_t>(at), sink, last.data());
      if (!ok) return fail(ok.error());
    }
    // Final norm and lm head for the last token only (llama.cpp's inp_out_ids).
    std::vector<float> normed(hp_.n_embd);
    rms_norm(last.data(), m_.weights().output_norm, hp_.n_embd, hp_.rms_eps, normed.data());
    const Matrix& head = m_.weights().lm_head();
    std::vector<float> logits(static_cast<size_t>(head.rows));
    matmul(head, normed.data(), 1, logits.data(), scratch_);
    return logits;
  }

  void rope(float* x, int64_t n_tokens, int64_t n_heads, int64_t row_stride, int32_t pos0) const {
    const int64_t n_dims = hp_.n_rot;
    const float theta_scale = std::pow(hp_.freq_base, -2.0f / static_cast<float>(n_dims));
    const float* ff = m_.weights().rope_freqs.empty() ? nullptr : m_.weights().rope_freqs.data();
    std::vector<float> cache(static_cast<size_t>(n_dims));
    for (int64_t t = 0; t < n_tokens; ++t) {
      float theta = static_cast<float>(pos0 + t);
      for (int64_t i0 = 0; i0 < n_dims; i0 += 2) {
        const float f = ff ? ff[i0 / 2] : 1.0f;
        const float th = hp_.freq_scale * (theta / f);
        cache[i0] = std::cos(th);
        cache[i0 + 1] = std::sin(th);
        theta *= theta_scale;
      }
      for (int64_t h = 0; h < n_heads; ++h) {
        float* v = x + t * row_stride + h * hp_.n_embd_head_k;
        const bool neox = hp_.rope_type == RopeType::neox;
        const int64_t offset = neox ? n_dims / 2 : 1;
        for (int64_t i0 = 0; i0 < n_dims; i0 += 2) {
          const int64_t ic = neox ? i0 / 2 : i0;
          const float c = cache[i0], s = cache[i0 + 1];
          const float x0 = v[ic], x1 = v[ic + offset];
          v[ic] = x0 * c - x1 * s;
          v[ic + offset] = x0 * s + x1 * c;
        }
      }
    }
  }

  void store_kv(uint32_t il, const float* k, const float* v, int64_t n, int32_t pos0) {
    const int64_t kd = hp_.n_embd_k_gqa(), vd = hp_.n_embd_v_gqa();
    const uint64_t k_row = layout::ggml_row_size(type_k_, kd);
    for (int64_t t = 0; t < n; ++t)
      store_cache_row(type_k_, k + t * kd, layers_[il].k + (pos0 + t) * k_row, kd, rot_k_);
    if (!v_trans_) {
      const uint64_t v_row = layout::ggml_row_size(type_v_, vd);
      for (int64_t t = 0; t < n; ++t)
        store_cache_row(type_v_, v + t * vd, layers_[il].v + (pos0 + t) * v_row, vd, rot_v_);
      return;
    }
    // Transposed V (-fa off): element (channel c, cell j) at c * kv_size + j, one
    // element at a time (llama_kv_cache::cpy_v with v_trans). Never quantized.
    const uint64_t el = layout::ggml_row_size(type_v_, 1);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < vd; ++c)
        store_cache_row(type_v_, v + t * vd + c,
                        layers_[il].v + (static_cast<uint64_t>(c) * kv_size_ + (pos0 + t)) * el, 1, 0);
  }

  void load_kv(uint32_t il, int64_t n_kv, float* k, float* v) const {
    const int64_t kd = hp_.n_embd_k_gqa(), vd = hp_.n_embd_v_gqa();
    const uint64_t k_row = layout::ggml_row_size(type_k_, kd);
    for (int64_t j = 0; j < n_kv; ++j) load_cache_row(type_k_, layers_[il].k + j * k_row, k + j * kd, kd);
    if (!v_trans_) {
      const uint64_t v_row = layout::ggml_row_size(type_v_, vd);
      for (int64_t j = 0; j < n_kv; ++j) load_cache_row(type_v_, layers_[il].v + j * v_row, v + j * vd, vd);
      return;
    }
    const uint64_t el = layout::ggml_row_size(type_v_, 1);
    std::vector<float> channel(static_cast<size_t>(n_kv));
    for (int64_t c = 0; c < vd; ++c) {
      load_cache_row(type_v_, layers_[il].v + static_cast<uint64_t>(c) * kv_size_ * el, channel.data(), n_kv);
      for (int64_t j = 0; j < n_kv; ++j) v[j * vd + c] = channel[static_cast<size_t>(j)];
    }
  }

  Result<void> ubatch(const int32_t* tokens, int64_t n, int32_t pos0, const RowSink* sink, float* last_hidden) {
    const int64_t E = hp_.n_embd, hd = hp_.n_embd_head_k, nq = hp_.n_embd_q();
    const int64_t kd = hp_.n_embd_k_gqa(), vd = hp_.n_embd_v_gqa(), ff = hp_.n_ff;
    const int64_t n_kv = pos0 + n;
    const Weights& W = m_.weights();

    // Every buffer of the step is kept across calls, so a step at 4096 cells does not
    // fault in megabytes of fresh pages (one minor fault per 4 KiB, dear on a VM: see
    // docs/protocol.md, "What the route adds, equal work") before its first multiply, and a
    // Context kept for the next prompt (a resident provider's) neither faults nor unmaps them
    // again. Every element used is written before it is read (x by the embeddings, cur by
    // rms_norm, load_kv fills n_kv rows, every sgemm has beta 0, rows by the copies), so
    // nothing of an earlier call reaches this one.
    const auto sized = [](std::vector<float>& buffer, int64_t count) -> std::vector<float>& {
      buffer.resize(static_cast<size_t>(count));
      return buffer;
    };
    std::vector<float>& x = sized(x_, n * E);
    for (int64_t t = 0; t < n; ++t)
      std::memcpy(&x[t * E], &W.tok_embd.data[static_cast<size_t>(tokens[t]) * E], E * sizeof(float));
    std::vector<float>& cur = sized(cur_, n * E);
    std::vector<float>& q = sized(q_, n * nq);
    std::vector<float>& k = sized(k_, n * kd);
    std::vector<float>& v = sized(v_, n * vd);
    std::vector<float>& attn = sized(attn_, n * nq);
    std::vector<float>& o = sized(o_, n * E);
    std::vector<float>& gate = sized(gate_, n * ff);
    std::vector<float>& up = sized(up_, n * ff);
    std::vector<float>& kc = sized(cache_k_f32_, n_kv * kd);
    std::vector<float>& vc = sized(cache_v_f32_, n_kv * vd);
    // One block of query rows at a time (below): at most kAttnRows x n_kv, whatever the prompt.
    std::vector<float>& scores = sized(scores_, std::min<int64_t>(n, kAttnRows) * n_kv);
    std::vector<float>& rows = rows_;  // sized when the sink takes them
    const float kq_scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const int64_t group = hp_.n_head / hp_.n_head_kv;

    for (uint32_t il = 0; il < hp_.n_layer; ++il) {
      const LayerWeights& L = W.layers[il];
      for (int64_t t = 0; t < n; ++t) rms_norm(&x[t * E], L.attn_norm, E, hp_.rms_eps, &cur[t * E]);
      matmul(L.wq, cur.data(), n, q.data(), scratch_);
      matmul(L.wk, cur.data(), n, k.data(), scratch_);
      matmul(L.wv, cur.data(), n, v.data(), scratch_);
      if (!L.bq.empty())
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t i = 0; i < nq; ++i) q[t * nq + i] += L.bq[i];
          for (int64_t i = 0; i < kd; ++i) k[t * kd + i] += L.bk[i];
          for (int64_t i = 0; i < vd; ++i) v[t * vd + i] += L.bv[i];
        }
      if (hp_.has_qk_norm) {
        for (int64_t h = 0; h < n * hp_.n_head; ++h) rms_norm(&q[h * hd], L.q_norm, hd, hp_.rms_eps, &q[h * hd]);
        for (int64_t h = 0; h < n * hp_.n_head_kv; ++h) rms_norm(&k[h * hd], L.k_norm, hd, hp_.rms_eps, &k[h * hd]);
      }
      rope(q.data(), n, hp_.n_head, nq, pos0);
      rope(k.data(), n, hp_.n_head_kv, kd, pos0);

      if (sink != nullptr) {
        rows.resize(static_cast<size_t>(n * (kd + vd)));  // exactly: the sink's span is all of it
        for (int64_t t = 0; t < n; ++t) {
          std::memcpy(&rows[t * (kd + vd)], &k[t * kd], kd * sizeof(float));
          std::memcpy(&rows[t * (kd + vd) + kd], &v[t * vd], vd * sizeof(float));
        }
        LayerRows lr{il, pos0, static_cast<uint32_t>(n), static_cast<uint32_t>(kd), static_cast<uint32_t>(vd), rows};
        auto ok = (*sink)(lr);
        if (!ok) return fail(ok.error().with_context(fmt::format("layer {} rows at position {}", il, pos0)));
      }

      // K and V go through the cache and are read back, so attention sees the cache
      // type's rounding exactly as llama.cpp's (which attends over views of the cache).
      store_kv(il, k.data(), v.data(), n, pos0);
      load_kv(il, n_kv, kc.data(), vc.data());
      if (rot_k_ > 0) hadamard_groups(q.data(), n * nq, rot_k_);
      if (type_k_ != GgmlType::F32)
        for (int64_t t = 0; t < n; ++t) round_like_vec_dot(type_k_, &q[t * nq], nq);

      // Query rows in blocks of kAttnRows: block rows t0..t0+m-1 attend to cells
      // 0..pos0+t0+m-1 only (causal), so the scores are m x that many cells, not n x n_kv
      // (4 GiB at 32768 tokens in one prefill), and the part above the diagonal is neither
      // computed nor multiplied by V. Each row's softmax is the one over the whole matrix;
      // only the length of the scores-by-V sum, and so how OpenBLAS blocks it, changes.
      for (int64_t t0 = 0; t0 < n; t0 += kAttnRows) {
        const int64_t m = std::min<int64_t>(kAttnRows, n - t0);
        const int64_t cells = pos0 + t0 + m;
        for (int64_t h = 0; h < hp_.n_head; ++h) {
          const int64_t kvh = h / group;
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(cells),
                      static_cast<int>(hd), kq_scale, &q[t0 * nq + h * hd], static_cast<int>(nq), &kc[kvh * hd],
                      static_cast<int>(kd), 0.0f, scores.data(), static_cast<int>(cells));
          for (int64_t t = 0; t < m; ++t) {
            float* s = &scores[t * cells];
            const int64_t valid = pos0 + t0 + t + 1;  // causal: cells 0..pos0+t0+t
            float max = -std::numeric_limits<float>::infinity();
            for (int64_t j = 0; j < valid; ++j) max = std::max(max, s[j]);
            double sum = 0.0;
            for (int64_t j = 0; j < valid; ++j) {
              s[j] = std::exp(s[j] - max);
              sum += s[j];
            }
            const float inv = static_cast<float>(1.0 / sum);
            for (int64_t j = 0; j < valid; ++j) s[j] *= inv;
            for (int64_t j = valid; j < cells; ++j) s[j] = 0.0f;
          }
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(hd),
                      static_cast<int>(cells), 1.0f, scores.data(), static_cast<int>(cells), &vc[kvh * hd],
                      static_cast<int>(vd), 0.0f, &attn[t0 * nq + h * hd], static_cast<int>(nq));
        }
      }
      // V was rotated into the cache; the same (self-inverse) rotation takes the output back.
      if (rot_v_ > 0) hadamard_groups(attn.data(), n * nq, rot_v_);
      matmul(L.wo, attn.data(), n, o.data(), scratch_);
      for (int64_t i = 0; i < n * E; ++i) x[i] += o[i];

      for (int64_t t = 0; t < n; ++t) rms_norm(&x[t * E], L.ffn_norm, E, hp_.rms_eps, &cur[t * E]);
      matmul(L.ffn_gate, cur.data(), n, gate.data(), scratch_);
      matmul(L.ffn_up, cur.data(), n, up.data(), scratch_);
      for (int64_t i = 0; i < n * ff; ++i) {
        const float g = gate[i];
        gate[i] = (g / (1.0f + std::exp(-g))) * up[i];  // SwiGLU: silu(gate) * up
      }
      matmul(L.ffn_down, gate.data(), n, o.data(), scratch_);
      for (int64_t i = 0; i < n * E; ++i) x[i] += o[i];
    }
    std::memcpy(last_hidden, &x[(n - 1) * E], E * sizeof(float));
    return {};
  }

  std::shared_ptr<const Model> model_;
  const LoadedModel& m_;
  const Hparams& hp_;
  KvMemory kv_;
  std::vector<LayerTensors> layers_;
  GgmlType type_k_ = GgmlType::F16, type_v_ = GgmlType::F16;
  bool v_trans_ = false;
  uint32_t kv_size_ = 0;
  uint64_t v_width_ = 0;
  int rot_k_ = 0, rot_v_ = 0;
  std::vector<float> scratch_;
  // ubatch's buffers, reused (see there)
  std::vector<float> x_, cur_, q_, k_, v_, attn_, o_, gate_, up_, rows_;
  std::vector<float> cache_k_f32_, cache_v_f32_, scores_;
};

}  // namespace

Result<std::unique_ptr<Context>> Context::create(std::shared_ptr<const Model> model, KvMemory kv, int n_threads) {
  if (!model) return fail(EINVAL, "no model");
  const auto* loaded = dynamic_cast<const LoadedModel*>(model.get());
  if (loaded == nullptr) return fail(EINVAL, "model was not loaded by refmodel::Model::from_gguf");
  if (n_threads > 0) openblas_set_num_threads(n_threads);
  auto ctx = std::make_unique<RefContext>(model, *loaded, std::move(kv));
  auto ok = ctx->init();
  if (!ok) return fail(ok.error());
  return std::unique_ptr<Context>(std::move(ctx));
}

}  // namespace kvshare::refmodel
