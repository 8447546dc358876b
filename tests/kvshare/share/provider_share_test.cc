#include "kvshare/share/provider_share.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

#include "kvshare/region/exporter.h"
#include "share_fixtures.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

using testing::FdLeakCheck;

TEST(ProviderFlags, ParsesAnFdList) {
  auto fds = parse_fd_list("3,4,5");
  ASSERT_TRUE(fds) << fds.error().what();
  EXPECT_EQ(*fds, (std::vector<int>{3, 4, 5}));
}

TEST(ProviderFlags, RefusesBadFdLists) {
  EXPECT_NE(parse_fd_list("3,x").error().message().find("\"x\" is not a number"), std::string::npos);
  EXPECT_NE(parse_fd_list("1").error().message().find("1 is stdin, stdout or stderr"), std::string::npos);
  EXPECT_NE(parse_fd_list("3,3").error().message().find("3 is listed twice"), std::string::npos);
  EXPECT_NE(parse_fd_list("").error().message().find("--fds is empty"), std::string::npos);
  EXPECT_NE(parse_fd_list("3,").error().message().find("\"\" is not a number"), std::string::npos);
}

class ProviderOpen : public FdLeakCheck {};

// Writes the header file and exports regions, returning duplicates of their fds as the
// numbers a provider would be told.
struct ProviderInputs {
  testing::TempDir dir;
  layout::ShareHeader header = testing::small_share_header();
  std::vector<ExportedRegion> regions;
  std::string layout_path;
  ProviderInputs() {
    layout_path = (dir / "layout.json").string();
    std::ofstream(layout_path) << layout::to_json(header, true);
    ExportOptions options;
    options.forced = RegionBackend::memfd;
    regions = std::move(*export_regions(header.layout, options));
  }
  std::vector<int> dup_fds() const {
    std::vector<int> fds;
    for (const auto& region : regions) fds.push_back(::fcntl(region.fd.get(), F_DUPFD_CLOEXEC, 3));
    return fds;
  }
};

TEST_F(ProviderOpen, MapsTheRegionsAndHandsOutLayerDestinations) {
  ProviderInputs inputs;
  auto share = ProviderShare::open(inputs.layout_path, inputs.dup_fds(), inputs.header);
  ASSERT_TRUE(share) << share.error().what();
  auto layer = share->layer(0, 1);
  ASSERT_TRUE(layer) << layer.error().what();
  layer->v.row(2)[0] = std::byte{0x42};
  const auto* placement = layer->v.placement;
  const auto& region = inputs.regions[placement->chunk];
  EXPECT_EQ(region.mapping.data()[placement->offset + 2 * layer->v.row_bytes], std::byte{0x42});
}

TEST_F(ProviderOpen, RefusesAHeaderFromAnotherModelNamingTheField) {
  ProviderInputs inputs;
  auto ours = testing::small_share_header(256, layout::GgmlType::Q8_0);
  auto share = ProviderShare::open(inputs.layout_path, inputs.dup_fds(), ours);
  ASSERT_FALSE(share);
  EXPECT_NE(share.error().message().find("params.type_k"), std::string::npos) << share.error().message();
}

TEST_F(ProviderOpen, NamesADescriptorThatIsNotOpen) {
  ProviderInputs inputs;
  auto fds = inputs.dup_fds();
  fds.push_back(1000);
  auto share = ProviderShare::open(inputs.layout_path, fds, inputs.header);
  ASSERT_FALSE(share);
  EXPECT_EQ(share.error().errno_value(), EBADF);
  EXPECT_NE(share.error().message().find("descriptor(s) 1000 are not open"), std::string::npos);
}

TEST_F(ProviderOpen, NamesAMissingLayoutFile) {
  ProviderInputs inputs;
  auto share = ProviderShare::open((inputs.dir / "missing.json").string(), inputs.dup_fds(), inputs.header);
  ASSERT_FALSE(share);
  EXPECT_EQ(share.error().errno_value(), ENOENT);
  EXPECT_NE(share.error().message().find("missing.json"), std::string::npos);
}

}  // namespace
}  // namespace kvshare
