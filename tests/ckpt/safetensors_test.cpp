// safetensors reader/writer: round trips, partial reads, and every malformed header rejected with
// a clear error.
#include "kiln/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "kiln/error.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

// A file: 8-byte length, the header text, then `data_bytes` bytes.
std::string raw_file(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + std::string(data_bytes, '\x01');
}

void expect_rejected(const std::string& bytes, const std::string& message) {
  TempDir dir;
  write_text(dir / "x.safetensors", bytes);
  try {
    read_safetensors_header(dir / "x.safetensors");
    FAIL() << "accepted a malformed file; expected: " << message;
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), HasSubstr(message));
    EXPECT_THAT(e.what(), HasSubstr("x.safetensors"));
  }
  EXPECT_THROW(SafetensorsReader(dir / "x.safetensors"), UserError);
}

TEST(CkptSafetensors, RoundTripsDtypesShapesAndByteRanges) {
  TempDir dir;
  std::vector<std::pair<std::string, torch::Tensor>> tensors = {
      {"f32", torch::randn({3, 5})},   {"bf16", torch::randn({7}).to(torch::kBFloat16)},
      {"i64", torch::arange(10)},      {"scalar", torch::tensor(3.5)},
      {"empty", torch::empty({0, 4})}, {"u8", torch::randint(0, 255, {13}, torch::kUInt8)},
  };
  auto written = write_safetensors(dir / "a.safetensors", tensors, {{"k", "v"}});
  EXPECT_EQ(written.size_bytes, std::filesystem::file_size(dir / "a.safetensors"));
  ASSERT_EQ(written.tensor_byte_ranges.size(), tensors.size());
  SafetensorsReader reader(dir / "a.safetensors");
  EXPECT_EQ(reader.header().metadata.at("k"), "v");
  EXPECT_EQ(reader.header().data_start % 8, 0u);
  for (size_t k = 0; k < tensors.size(); ++k) {
    const auto* entry = reader.find(tensors[k].first);
    ASSERT_NE(entry, nullptr);
    EXPECT_EQ(reader.header().data_start + entry->begin, written.tensor_byte_ranges[k].first);
    EXPECT_EQ(reader.header().data_start + entry->end, written.tensor_byte_ranges[k].second);
  }
  auto back = read_safetensors(dir / "a.safetensors");
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, tensor] : back) {
    auto it = std::find_if(tensors.begin(), tensors.end(),
                           [&](const auto& t) { return t.first == name; });
    ASSERT_NE(it, tensors.end());
    EXPECT_TRUE(torch::equal(tensor, it->second)) << name;
  }
}

TEST(CkptSafetensors, ReaderReadsPartsAndRejectsOutOfRange) {
  TempDir dir;
  auto t = torch::arange(100, torch::kInt32);
  write_safetensors(dir / "a.safetensors", {{"t", t}});
  SafetensorsReader reader(dir / "a.safetensors");
  int32_t values[3];
  reader.read(*reader.find("t"), 40 * 4, sizeof(values), values);
  EXPECT_EQ(values[0], 40);
  EXPECT_EQ(values[2], 42);
  EXPECT_THROW(reader.read(*reader.find("t"), 99 * 4, 8, values), UserError);
  EXPECT_THROW(reader.read_raw(reader.size_bytes() - 2, 4, values), UserError);
}

TEST(CkptSafetensors, RejectsHeaderLongerThanTheFile) {
  std::string bytes = raw_file("{}", 0);
  const uint64_t huge = 1000;
  std::memcpy(bytes.data(), &huge, 8);
  expect_rejected(bytes, "exceeds the file");
}

TEST(CkptSafetensors, RejectsOverlappingOffsets) {
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           12),
                  "overlaps");
}

TEST(CkptSafetensors, RejectsOutOfRangeOffsets) {
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
                  "outside the data");
}

TEST(CkptSafetensors, RejectsUnknownDtype) {
  expect_rejected(raw_file(R"({"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", 8),
                  "unknown dtype");
}

TEST(CkptSafetensors, RejectsShapeDisagreeingWithOffsetsGapsAndTrailingBytes) {
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                  "need 12 bytes");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "gap");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8),
                  "not described");
  expect_rejected(raw_file("{not json", 0), "not valid JSON");
  expect_rejected("abc", "shorter than its 8-byte header length");
}

// numel stays under 2^62 but numel * element size wraps to 0: must be refused, never accepted
// as an empty tensor (reading it would then fail outside the UserError contract).
TEST(CkptSafetensors, RejectsShapesWhoseByteSizeOverflows) {
  expect_rejected(
      raw_file(R"({"a":{"dtype":"F64","shape":[2147483648,2147483648],"data_offsets":[0,0]}})", 0),
      "shape too large");
  expect_rejected(
      raw_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", 0),
      "shape too large");
  expect_rejected(
      raw_file(R"({"a":{"dtype":"BF16","shape":[9223372036854775808],"data_offsets":[0,0]}})", 0),
      "shape too large");
}

TEST(CkptSafetensors, WriteFailureLeavesTheExistingFileIntact) {
  TempDir dir;
  write_safetensors(dir / "a.safetensors", {{"t", torch::ones({4})}});
  EXPECT_THROW(
      write_safetensors(dir / "a.safetensors", {{"t", torch::ones({4})}, {"t", torch::ones({4})}}),
      UserError);
  EXPECT_THROW(write_safetensors(dir / "missing" / "a.safetensors", {{"t", torch::ones({4})}}),
               UserError);
  EXPECT_TRUE(torch::equal(read_safetensors(dir / "a.safetensors")[0].second, torch::ones({4})));
}

}  // namespace
}  // namespace kiln::testing
