// Models the reference transformer refuses, each with an error naming what is wrong.
#include <gtest/gtest.h>

#include <functional>

#include "layout/gguf_reader.h"
#include "layout/gguf_writer.h"
#include "layout/model_hparams.h"
#include "layout/model_shape.h"
#include "refmodel/engine.h"
#include "refmodel/model_generator.h"
#include "refmodel/model_impl.h"

namespace kvshare::refmodel {
namespace {

using layout::GgufTensorInfo;

// Re-encodes a generated model with its metadata edited by `edit_md` and each tensor
// passed through `edit_tensor` (return false to drop it; may change shape and bytes).
using TensorEdit = std::function<bool(GgufTensorInfo&, std::vector<std::byte>&)>;
std::vector<std::byte> edited_model(const std::function<void(layout::GgufMetadata&)>& edit_md,
                                    const TensorEdit& edit_tensor = nullptr) {
  auto bytes = generate_model_bytes({});
  EXPECT_TRUE(bytes);
  auto file = layout::parse_gguf(*bytes, "generated");
  EXPECT_TRUE(file);
  layout::GgufWriter w;
  layout::GgufMetadata md = file->metadata;
  if (edit_md) edit_md(md);
  for (const auto& [key, value] : md.entries()) w.set(key, value);
  for (GgufTensorInfo info : file->tensors) {
    auto data = layout::tensor_data(*file, info);
    std::vector<std::byte> owned(data->begin(), data->end());
    if (edit_tensor && !edit_tensor(info, owned)) continue;
    std::vector<int64_t> ne(info.ne.begin(), info.ne.begin() + info.n_dims);
    auto ok = w.add_tensor(info.name, info.type, ne, owned);
    EXPECT_TRUE(ok) << ok.error().what();
  }
  auto out = w.finish();
  EXPECT_TRUE(out) << out.error().what();
  return *out;
}

std::string load_error(const std::vector<std::byte>& bytes) {
  auto model = Model::from_gguf(bytes, nullptr, "bad.gguf");
  if (model) return "";
  return model.error().message();
}

TEST(ModelLoad, RefusesAnUnknownArchitectureNamingIt) {
  const auto msg = load_error(
      edited_model([](layout::GgufMetadata& md) { md.set("general.architecture", {std::string("mamba")}); }));
  EXPECT_NE(msg.find("bad.gguf"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"mamba\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("llama, qwen2, qwen3"), std::string::npos) << msg;
}

TEST(ModelLoad, RefusesAMissingTensorNamingIt) {
  const auto msg = load_error(edited_model(
      nullptr, [](GgufTensorInfo& t, std::vector<std::byte>&) { return t.name != "blk.1.ffn_up.weight"; }));
  EXPECT_NE(msg.find("tensor \"blk.1.ffn_up.weight\" is missing"), std::string::npos) << msg;
}

TEST(ModelLoad, RefusesATensorOfTheWrongShapeGivingBothShapes) {
  const auto msg = load_error(edited_model(nullptr, [](GgufTensorInfo& t, std::vector<std::byte>& data) {
    if (t.name == "blk.0.attn_k_norm.weight") {
      t.ne[0] /= 2;
      data.resize(data.size() / 2);
    }
    return true;
  }));
  EXPECT_NE(msg.find("tensor \"blk.0.attn_k_norm.weight\" has shape [32, 1, 1, 1], expected [64, 1, 1, 1]"),
            std::string::npos)
      << msg;
}

TEST(ModelLoad, RefusesAnUnsupportedRopeScalingTypeNamingIt) {
  const auto msg = load_error(edited_model([](layout::GgufMetadata& md) {
    md.set("qwen3.rope.scaling.type", {std::string("yarn")});
    md.set("qwen3.rope.scaling.factor", {4.0f});
  }));
  EXPECT_NE(msg.find("rope scaling type \"yarn\""), std::string::npos) << msg;
}

TEST(ModelLoad, AcceptsLinearRopeScaling) {
  auto bytes = edited_model([](layout::GgufMetadata& md) {
    md.set("qwen3.rope.scaling.type", {std::string("linear")});
    md.set("qwen3.rope.scaling.factor", {2.0f});
  });
  auto model = Model::from_gguf(bytes, nullptr, "linear.gguf");
  EXPECT_TRUE(model) << model.error().what();
}

// Pins the double read: the transformer read rope and norm keys itself, the shape never did.
TEST(ModelLoad, RefusesABadHyperparameterWithTheShapeReadsMessage) {
  for (const char* suffix : {"rope.freq_base", "rope.dimension_count", "rope.scaling.type",
                             "attention.layer_norm_rms_epsilon", "attention.head_count_kv"}) {
    const std::string key = std::string("qwen3.") + suffix;
    const auto bytes = edited_model([&](layout::GgufMetadata& md) { md.set(key, layout::GgufValue{true}); });
    auto file = layout::parse_gguf(bytes, "bad.gguf");
    ASSERT_TRUE(file) << file.error().what();
    auto shape = layout::derive_model_shape(file->metadata);
    ASSERT_FALSE(shape) << key;
    auto read = layout::read_model_hparams(file->metadata, "bad.gguf");
    ASSERT_FALSE(read) << key;
    EXPECT_NE(shape.error().message().find("\"" + key + "\" has wrong type"), std::string::npos)
        << shape.error().message();
    EXPECT_EQ(read.error().message(), "model bad.gguf: " + shape.error().message());
    EXPECT_EQ(load_error(bytes), read.error().message());
  }
}

TEST(ModelLoad, TakesTheTransformersNumbersFromTheShapeRead) {
  auto bytes = edited_model([](layout::GgufMetadata& md) {
    md.set("qwen3.rope.scale_linear", {4.0f});
    md.set("qwen3.rope.freq_base", {50000.0f});
    md.set("qwen3.attention.layer_norm_rms_epsilon", {1e-5f});
  });
  auto file = layout::parse_gguf(bytes, "scaled.gguf");
  ASSERT_TRUE(file) << file.error().what();
  auto read = layout::read_model_hparams(file->metadata, "scaled.gguf");
  ASSERT_TRUE(read) << read.error().what();
  auto model = Model::from_gguf(bytes, nullptr, "scaled.gguf");
  ASSERT_TRUE(model) << model.error().what();
  const Hparams& hp = static_cast<const LoadedModel&>(**model).hparams();
  EXPECT_EQ(hp.freq_scale, 0.25f);
  EXPECT_EQ(hp.freq_scale, read->rope_freq_scale);
  EXPECT_EQ(hp.freq_base, 50000.0f);
  EXPECT_EQ(hp.rms_eps, 1e-5f);
  EXPECT_EQ(hp.n_rot, read->n_rot);
  EXPECT_EQ(hp.n_embd_head_k, read->n_embd_head_k_full);
  EXPECT_EQ(hp.n_head_kv, read->n_head_kv[0]);
  EXPECT_EQ(hp.n_layer, read->n_layer());
}

TEST(ModelLoad, RefusesATruncatedFile) {
  auto bytes = generate_model_bytes({});
  ASSERT_TRUE(bytes);
  bytes->resize(bytes->size() / 2);
  auto model = Model::from_gguf(*bytes, nullptr, "cut.gguf");
  ASSERT_FALSE(model);
  EXPECT_NE(model.error().message().find("cut.gguf"), std::string::npos) << model.error().message();
}

}  // namespace
}  // namespace kvshare::refmodel
