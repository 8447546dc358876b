// The worked-example model (2 layers, 2 KV heads of 64, f16) as a share header, for the
// remote route's tests: K and V rows are 256 bytes, a tensor is kv_size rows.
#pragma once

#include <gtest/gtest.h>

#include "layout/model_shape.h"
#include "layout/share_header.h"
#include "shape_fixtures.h"

namespace kvshare::layout::testing {

// n_seq_max > 1: as llama-server -np N without --kv-unified, N streams of n_ctx / N cells.
inline ShareHeader remote_example_header(uint32_t n_ctx = 512, bool flash_attn = true, uint32_t n_seq_max = 1) {
  KvParams params;
  params.n_ctx = n_ctx;
  params.n_seq_max = n_seq_max;
  params.kv_unified = n_seq_max == 1;
  params.flash_attn = flash_attn;
  auto model = derive_model_shape(worked_example_model().metadata());
  EXPECT_TRUE(model.has_value());
  ModelFingerprint fp;
  fp.arch = "llama";
  fp.n_layer = 2;
  fp.n_embd = 256;
  auto header = make_share_header(fp, *model, params);
  EXPECT_TRUE(header.has_value()) << header.error().what();
  return *header;
}

}  // namespace kvshare::layout::testing
