// The forward pass against a straightforward double-precision evaluation of the same
// weights, and the consistency of its three entry points (batched, incremental, sink).
#include <gtest/gtest.h>

#include <cmath>

#include "layout/half.h"
#include "refmodel/model_impl.h"
#include "refmodel/quant.h"
#include "refmodel/tiny_model.h"

namespace kvshare::refmodel {
namespace {

using layout::GgmlType;
using testing::load_generated;
using testing::make_buffer_kv;
using testing::small_params;

// The whole model in double precision, written from the papers' formulas rather than
// from context.cc: y = W x, RMSNorm, RoPE with theta_i = pos * base^(-2i/d), softmax
// attention over positions <= t, SwiGLU. Returns the last token's logits.
std::vector<double> reference_logits(const LoadedModel& m, const std::vector<int32_t>& tokens) {
  const Hparams& hp = m.hparams();
  const Weights& W = m.weights();
  const size_t E = hp.n_embd, hd = hp.n_embd_head_k, T = tokens.size();
  using Vec = std::vector<double>;
  auto matvec = [](const Matrix& w, const Vec& x) {
    Vec y(static_cast<size_t>(w.rows));
    for (int64_t r = 0; r < w.rows; ++r) {
      double s = 0;
      for (int64_t c = 0; c < w.cols; ++c) s += static_cast<double>(w.data[r * w.cols + c]) * x[c];
      y[r] = s;
    }
    return y;
  };
  auto norm = [&](const double* x, size_t n, const std::vector<float>& w, double* y) {
    double ss = 0;
    for (size_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const double scale = 1.0 / std::sqrt(ss / n + hp.rms_eps);
    for (size_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
  };
  auto rope = [&](double* v, size_t pos) {
    for (size_t i = 0; i < hd / 2; ++i) {
      const double theta = hp.freq_scale * pos * std::pow(static_cast<double>(hp.freq_base), -2.0 * i / hd);
      const size_t a = hp.rope_type == RopeType::neox ? i : 2 * i;
      const size_t b = hp.rope_type == RopeType::neox ? i + hd / 2 : 2 * i + 1;
      const double x0 = v[a], x1 = v[b];
      v[a] = x0 * std::cos(theta) - x1 * std::sin(theta);
      v[b] = x0 * std::sin(theta) + x1 * std::cos(theta);
    }
  };
  std::vector<Vec> x(T, Vec(E));
  for (size_t t = 0; t < T; ++t)
    for (size_t i = 0; i < E; ++i) x[t][i] = W.tok_embd.data[tokens[t] * E + i];
  for (uint32_t il = 0; il < hp.n_layer; ++il) {
    const LayerWeights& L = W.layers[il];
    std::vector<Vec> q(T), k(T), v(T);
    for (size_t t = 0; t < T; ++t) {
      Vec h(E);
      norm(x[t].data(), E, L.attn_norm, h.data());
      q[t] = matvec(L.wq, h);
      k[t] = matvec(L.wk, h);
      v[t] = matvec(L.wv, h);
      for (size_t i = 0; i < L.bq.size(); ++i) q[t][i] += L.bq[i];
      for (size_t i = 0; i < L.bk.size(); ++i) k[t][i] += L.bk[i];
      for (size_t i = 0; i < L.bv.size(); ++i) v[t][i] += L.bv[i];
      for (size_t h0 = 0; h0 < hp.n_head; ++h0) {
        if (hp.has_qk_norm) norm(&q[t][h0 * hd], hd, L.q_norm, &q[t][h0 * hd]);
        rope(&q[t][h0 * hd], t);
      }
      for (size_t h0 = 0; h0 < hp.n_head_kv; ++h0) {
        if (hp.has_qk_norm) norm(&k[t][h0 * hd], hd, L.k_norm, &k[t][h0 * hd]);
        rope(&k[t][h0 * hd], t);
      }
    }
    for (size_t t = 0; t < T; ++t) {
      Vec out(hp.n_head * hd, 0.0);
      for (size_t h0 = 0; h0 < hp.n_head; ++h0) {
        const size_t kvh = h0 / (hp.n_head / hp.n_head_kv);
        Vec s(t + 1);
        double max = -1e300;
        for (size_t j = 0; j <= t; ++j) {
          double d = 0;
          for (size_t i = 0; i < hd; ++i) d += q[t][h0 * hd + i] * k[j][kvh * hd + i];
          s[j] = d / std::sqrt(static_cast<double>(hd));
          max = std::max(max, s[j]);
        }
        double sum = 0;
        for (auto& e : s) sum += (e = std::exp(e - max));
        for (size_t j = 0; j <= t; ++j)
          for (size_t i = 0; i < hd; ++i) out[h0 * hd + i] += s[j] / sum * v[j][kvh * hd + i];
      }
      const Vec o = matvec(L.wo, out);
      for (size_t i = 0; i < E; ++i) x[t][i] += o[i];
      Vec h(E);
      norm(x[t].data(), E, L.ffn_norm, h.data());
      const Vec g = matvec(L.ffn_gate, h), u = matvec(L.ffn_up, h);
      Vec a(g.size());
      for (size_t i = 0; i < g.size(); ++i) a[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
      const Vec d = matvec(L.ffn_down, a);
      for (size_t i = 0; i < E; ++i) x[t][i] += d[i];
    }
  }
  Vec h(E);
  norm(x[T - 1].data(), E, W.output_norm, h.data());
  return matvec(W.lm_head(), h);
}

std::vector<int32_t> prompt(int n, int n_vocab) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 37 + 5) % n_vocab);
  return t;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

void expect_matches_double(const GeneratorOptions& options) {
  auto model = load_generated(options);
  ASSERT_NE(model, nullptr);
  auto kv = make_buffer_kv(*model, small_params(256, GgmlType::F32, GgmlType::F32));
  auto ctx = Context::create(model, kv->kv, 1);
  ASSERT_TRUE(ctx) << ctx.error().what();
  const auto tokens = prompt(19, model->tokenizer().n_vocab());
  auto logits = (*ctx)->decode(tokens, 0);
  ASSERT_TRUE(logits) << logits.error().what();
  const auto ref = reference_logits(static_cast<const LoadedModel&>(*model), tokens);
  ASSERT_EQ(logits->size(), ref.size());
  double scale = 0;
  for (double r : ref) scale = std::max(scale, std::abs(r));
  EXPECT_LT(max_abs_diff(*logits, ref), 1e-4 * scale + 1e-4) << options.arch;
  EXPECT_EQ(sample_greedy(*logits), std::max_element(ref.begin(), ref.end()) - ref.begin());
}

TEST(Forward, Qwen3MatchesADoublePrecisionEvaluation) { expect_matches_double({}); }

TEST(Forward, LlamaMatchesADoublePrecisionEvaluation) {
  GeneratorOptions o;
  o.arch = "llama";
  o.n_head = 2;
  o.n_head_kv = 2;
  expect_matches_double(o);
}

TEST(Forward, Qwen2WithBiasesMatchesADoublePrecisionEvaluation) {
  GeneratorOptions o;
  o.arch = "qwen2";
  o.n_head = 8;
  o.n_head_kv = 2;
  o.head_dim = 16;
  expect_matches_double(o);
}

TEST(Forward, IncrementalDecodeGivesTheBatchedLogits) {
  auto model = load_generated({});
  ASSERT_NE(model, nullptr);
  const auto tokens = prompt(12, model->tokenizer().n_vocab());
  auto kv_a = make_buffer_kv(*model, small_params());
  auto kv_b = make_buffer_kv(*model, small_params());
  auto a = Context::create(model, kv_a->kv, 1);
  auto b = Context::create(model, kv_b->kv, 1);
  ASSERT_TRUE(a && b);
  auto batched = (*a)->decode(tokens, 0);
  ASSERT_TRUE(batched);
  auto first = (*b)->decode(std::span(tokens).first(5), 0);
  ASSERT_TRUE(first);
  Result<std::vector<float>> last;
  for (size_t i = 5; i < tokens.size(); ++i) {
    last = (*b)->decode(std::span(tokens).subspan(i, 1), static_cast<int32_t>(i));
    ASSERT_TRUE(last) << last.error().what();
  }
  // Equal up to float reordering: BLAS sums a batch of one in another order, and an f16
  // cache can round a K element to the neighbouring half.
  float scale = 0;
  for (float v : *batched) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < batched->size(); ++i) EXPECT_NEAR((*batched)[i], (*last)[i], 2e-4f * scale) << i;
  EXPECT_EQ(sample_greedy(*batched), sample_greedy(*last));
}

TEST(Forward, PrefillHandsTheSinkTheRowsTheCacheStores) {
  auto model = load_generated({});
  ASSERT_NE(model, nullptr);
  const auto& hp = static_cast<const LoadedModel&>(*model).hparams();
  const auto tokens = prompt(9, model->tokenizer().n_vocab());
  auto kv = make_buffer_kv(*model, small_params(256, GgmlType::F16, GgmlType::F16));
  auto ctx = Context::create(model, kv->kv, 1);
  ASSERT_TRUE(ctx);
  std::vector<std::vector<float>> rows(hp.n_layer);
  auto ok = (*ctx)->prefill(tokens, [&](const LayerRows& r) -> Result<void> {
    EXPECT_EQ(r.pos0, 0);
    EXPECT_EQ(r.n_tokens, tokens.size());
    EXPECT_EQ(r.n_embd_k_gqa, hp.n_embd_k_gqa());
    rows[r.il].assign(r.rows.begin(), r.rows.end());
    return {};
  });
  ASSERT_TRUE(ok) << ok.error().what();
  const uint32_t kd = hp.n_embd_k_gqa(), vd = hp.n_embd_v_gqa();
  for (uint32_t il = 0; il < hp.n_layer; ++il) {
    ASSERT_EQ(rows[il].size(), tokens.size() * (kd + vd));
    const auto* kt = kv->kv.layout.find(0, il, layout::TensorKind::k);
    const auto* vt = kv->kv.layout.find(0, il, layout::TensorKind::v);
    const auto* kbytes = reinterpret_cast<const uint16_t*>(kv->kv.chunks[kt->chunk].data() + kt->offset);
    const auto* vbytes = reinterpret_cast<const uint16_t*>(kv->kv.chunks[vt->chunk].data() + vt->offset);
    for (size_t t = 0; t < tokens.size(); ++t) {
      for (uint32_t i = 0; i < kd; ++i)
        ASSERT_EQ(kbytes[t * kd + i], layout::fp32_to_fp16(rows[il][t * (kd + vd) + i])) << il << " " << t << " " << i;
      for (uint32_t i = 0; i < vd; ++i)
        ASSERT_EQ(vbytes[t * vd + i], layout::fp32_to_fp16(rows[il][t * (kd + vd) + kd + i]));
    }
  }
}

// A prefill attends over the whole prompt in blocks of 512 query rows (context.cc,
// kAttnRows) where a decode takes one ubatch of 512 at a time: the rows it hands the sink
// are the cells a batched decode of the same ids stores, every layer, across three blocks.
TEST(Forward, PrefillAcrossAttentionBlocksHandsTheRowsABatchedDecodeStores) {
  GeneratorOptions options;
  options.residual_gain = 3.0f;  // layer 1's K/V depend on layer 0's attention over every earlier cell
  auto model = load_generated(options);
  ASSERT_NE(model, nullptr);
  const auto& hp = static_cast<const LoadedModel&>(*model).hparams();
  const auto tokens = prompt(1100, model->tokenizer().n_vocab());
  auto kv_prefill = make_buffer_kv(*model, small_params(1280, GgmlType::F32, GgmlType::F32));
  auto kv_decode = make_buffer_kv(*model, small_params(1280, GgmlType::F32, GgmlType::F32));
  auto a = Context::create(model, kv_prefill->kv, 1);
  auto b = Context::create(model, kv_decode->kv, 1);
  ASSERT_TRUE(a && b);
  std::vector<std::vector<float>> rows(hp.n_layer);
  auto ok = (*a)->prefill(tokens, [&](const LayerRows& r) -> Result<void> {
    rows[r.il].assign(r.rows.begin(), r.rows.end());
    return {};
  });
  ASSERT_TRUE(ok) << ok.error().what();
  ASSERT_TRUE((*b)->decode(tokens, 0));
  const uint32_t kd = hp.n_embd_k_gqa(), vd = hp.n_embd_v_gqa();
  for (uint32_t il = 0; il < hp.n_layer; ++il) {
    ASSERT_EQ(rows[il].size(), tokens.size() * (kd + vd));
    const auto* kt = kv_decode->kv.layout.find(0, il, layout::TensorKind::k);
    const auto* vt = kv_decode->kv.layout.find(0, il, layout::TensorKind::v);
    const auto* k = reinterpret_cast<const float*>(kv_decode->kv.chunks[kt->chunk].data() + kt->offset);
    const auto* v = reinterpret_cast<const float*>(kv_decode->kv.chunks[vt->chunk].data() + vt->offset);
    double max_diff = 0, scale = 0;
    for (size_t t = 0; t < tokens.size(); ++t) {
      for (uint32_t i = 0; i < kd + vd; ++i) {
        const float stored = i < kd ? k[t * kd + i] : v[t * vd + (i - kd)];
        const float handed = rows[il][t * (kd + vd) + i];
        max_diff = std::max(max_diff, static_cast<double>(std::abs(stored - handed)));
        scale = std::max(scale, static_cast<double>(std::abs(stored)));
      }
    }
    // Up to float reordering: OpenBLAS rounds a row with the number of rows in the batch
    // (1100 here, 512, 512 and 76 there). A block that saw a cell past its last row's
    // position, or missed one, misses by orders of magnitude.
    EXPECT_LE(max_diff, 1e-4 * scale) << "layer " << il;
  }
}

TEST(Forward, TransposedVCacheGivesTheSameLogits) {
  auto model = load_generated({});
  ASSERT_NE(model, nullptr);
  const auto tokens = prompt(10, model->tokenizer().n_vocab());
  auto kv_fa = make_buffer_kv(*model, small_params(256, GgmlType::F16, GgmlType::F16, true));
  auto kv_tr = make_buffer_kv(*model, small_params(256, GgmlType::F16, GgmlType::F16, false));
  ASSERT_TRUE(kv_tr->kv.memory.kv_caches[0].v_trans);
  auto a = Context::create(model, kv_fa->kv, 1);
  auto b = Context::create(model, kv_tr->kv, 1);
  ASSERT_TRUE(a && b);
  auto la = (*a)->decode(tokens, 0);
  auto lb = (*b)->decode(tokens, 0);
  ASSERT_TRUE(la && lb);
  EXPECT_EQ(*la, *lb);
}

TEST(Forward, Q80CacheWithRotationStaysCloseToF32) {
  auto model = load_generated({});
  ASSERT_NE(model, nullptr);
  const auto tokens = prompt(16, model->tokenizer().n_vocab());
  auto kv_f = make_buffer_kv(*model, small_params(256, GgmlType::F32, GgmlType::F32));
  auto kv_q = make_buffer_kv(*model, small_params(256, GgmlType::Q8_0, GgmlType::Q8_0));
  auto a = Context::create(model, kv_f->kv, 1);
  auto b = Context::create(model, kv_q->kv, 1);
  ASSERT_TRUE(a && b) << (b ? "" : b.error().what());
  auto la = (*a)->decode(tokens, 0);
  auto lb = (*b)->decode(tokens, 0);
  ASSERT_TRUE(la && lb);
  double m = 0, scale = 0;
  for (size_t i = 0; i < la->size(); ++i) {
    m = std::max(m, static_cast<double>(std::abs((*la)[i] - (*lb)[i])));
    scale = std::max(scale, static_cast<double>(std::abs((*la)[i])));
  }
  EXPECT_LT(m, 0.05 * scale);
  EXPECT_GT(m, 0.0);  // the quantized cache really is in use
}

TEST(Forward, RefusesTokensOutsideTheVocabulary) {
  auto model = load_generated({});
  auto kv = make_buffer_kv(*model, small_params());
  auto ctx = Context::create(model, kv->kv, 1);
  ASSERT_TRUE(ctx);
  const std::vector<int32_t> tokens{1, 2, model->tokenizer().n_vocab()};
  auto r = (*ctx)->decode(tokens, 0);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("outside the vocabulary"), std::string::npos) << r.error().message();
}

TEST(Forward, RefusesTokensPastTheContext) {
  auto model = load_generated({});
  auto kv = make_buffer_kv(*model, small_params(256));
  auto ctx = Context::create(model, kv->kv, 1);
  ASSERT_TRUE(ctx);
  const std::vector<int32_t> tokens(10, 1);
  auto r = (*ctx)->decode(tokens, 250);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().errno_value(), ENOSPC);
  EXPECT_NE(r.error().message().find("exceed the context of 256 cells"), std::string::npos) << r.error().message();
}

}  // namespace
}  // namespace kvshare::refmodel
