// A provider's share imported into the NPU (xdna/npu_share.h), on the stand-in driver: no
// machine here has an NPU. The real device path is FindsTheRealNpuWhenThisMachineHasOne.
#include "xdna/npu_share.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include "fake_amdxdna.h"
#include "kvshare/region/exporter.h"
#include "support/cache_fixture.h"
#include "support/recurrent_fixture.h"
#include "support/test_support.h"

namespace kvshare::xdna {
namespace {

using kvshare::testing::CacheSpec;
using kvshare::testing::FdLeakCheck;
using kvshare::testing::make_memory;
using kvshare::xdna::testing::fake_device;
using kvshare::xdna::testing::FakeDriver;
using kvshare::xdna::testing::ScopedFakeDriver;

class NpuShareTest : public FdLeakCheck {
 protected:
  // A two-layer KV cache unless a test shares another memory.
  void SetUp() override {
    FdLeakCheck::SetUp();
    CacheSpec spec;
    spec.n_embd_k = {64, 64};
    spec.n_embd_v = {64, 64};
    share_memory(make_memory(spec));
  }
  // The decoder's side: a one-chunk memfd region for `memory`; the provider's side: the
  // same region imported from duplicated fds.
  void share_memory(const layout::MemoryShape& memory) {
    share_.reset();
    layout_ = layout::share_layout(memory);
    ASSERT_EQ(layout_.chunks.size(), 1u);
    ExportOptions options;
    options.forced = RegionBackend::memfd;
    auto regions = export_regions(layout_, options);
    ASSERT_TRUE(regions) << regions.error().what();
    std::vector<Fd> fds;
    for (const auto& region : *regions) fds.emplace_back(::dup(region.fd.get()));
    auto imported = ImportedShare::import(layout_, std::move(fds), {}, true);
    ASSERT_TRUE(imported) << imported.error().what();
    share_.emplace(std::move(*imported));
  }
  void TearDown() override {
    share_.reset();  // its fds, before the leak check counts
    FdLeakCheck::TearDown();
  }
  layout::ShareLayout layout_;
  std::optional<ImportedShare> share_;
};

TEST_F(NpuShareTest, AddressesEachTensorAtItsChunksBufferAddressPlusItsOffset) {
  ScopedFakeDriver fake_driver;
  {
    auto npu = NpuShare::import(fake_device(), *share_);
    ASSERT_TRUE(npu) << npu.error().what();
    EXPECT_EQ(npu->buffers().size(), 1u);
    for (const char* name : {"cache_k_l0", "cache_v_l0", "cache_k_l1", "cache_v_l1"}) {
      const layout::SharedTensor* placed = layout_.find(name);
      ASSERT_NE(placed, nullptr) << name;
      auto address = npu->device_address(*share_, name);
      ASSERT_TRUE(address) << address.error().what();
      EXPECT_EQ(*address, 0x40000u + placed->offset) << name;
    }
    // Distinct tensors, distinct addresses: the offsets are not all 0.
    EXPECT_NE(*npu->device_address(*share_, "cache_k_l0"), *npu->device_address(*share_, "cache_v_l1"));
    auto none = npu->device_address(*share_, "cache_k_l9");
    ASSERT_FALSE(none);
    EXPECT_NE(none.error().message().find("cache_k_l9"), std::string::npos) << none.error().message();
  }
  EXPECT_EQ(FakeDriver::gem_closes, 1);  // the buffer objects went with the NpuShare
}

TEST_F(NpuShareTest, AddressesARecurrentModelsStateTensorsByName) {
  share_memory(kvshare::testing::mamba2_memory());
  ScopedFakeDriver fake_driver;
  auto npu = NpuShare::import(fake_device(), *share_);
  ASSERT_TRUE(npu) << npu.error().what();
  for (const char* name : {"cache_r_l0", "cache_s_l0", "cache_r_l1", "cache_s_l1"}) {
    const layout::SharedTensor* placed = layout_.find(name);
    ASSERT_NE(placed, nullptr) << name;
    auto address = npu->device_address(*share_, name);
    ASSERT_TRUE(address) << address.error().what();
    EXPECT_EQ(*address, 0x40000u + placed->offset) << name;
  }
  EXPECT_NE(*npu->device_address(*share_, "cache_r_l0"), *npu->device_address(*share_, "cache_s_l1"));
}

TEST_F(NpuShareTest, NamesTheDeviceAndChunkWhenTheDriverRefusesTheImport) {
  ScopedFakeDriver fake_driver(/*fail_bo_info=*/true);
  auto npu = NpuShare::import(fake_device(), *share_);
  ASSERT_FALSE(npu);
  EXPECT_EQ(npu.error().errno_value(), EINVAL);
  EXPECT_NE(npu.error().message().find("importing the share into /dev/accel/accel0"), std::string::npos)
      << npu.error().message();
  EXPECT_NE(npu.error().message().find("region chunk 0"), std::string::npos) << npu.error().message();
}

}  // namespace
}  // namespace kvshare::xdna
