// index.json validation (hostile paths, bad chunks, checksums) and a randomized test of the index
// and safetensors parsers (a fixed number of cases, each from its own fixed seed): any input
// either parses or throws UserError, never crashes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>

#include "ckpt/ckpt_helpers.h"
#include "ckpt/internal.h"
#include "core/files.h"
#include "core/strings.h"
#include "kiln/checkpoint.h"
#include "kiln/error.h"
#include "kiln/safetensors.h"

namespace kiln::testing {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

// A committed two-tensor checkpoint in `dir`; returns its index as JSON.
json make_checkpoint(const std::filesystem::path& dir) {
  auto comm = single_process_communicator();
  Checkpointer checkpointer(CheckpointOptions{dir, 3, 0, false}, *comm);
  SaveRequest request;
  request.step = 7;
  request.tensors = {{"model/w", torch::randn({8, 4})}, {"model/b", torch::randn({8})}};
  checkpointer.save(request);
  return json::parse(read_file(dir / "step-7" / "index.json"));
}

// Rewrites index.json after `edit`, with a valid checksum (a hostile writer would do the same).
void rewrite_index(const std::filesystem::path& step_dir, json index) {
  write_file_atomic(step_dir / "index.json", ckpt::index_text_with_checksum(std::move(index)));
}

void expect_index_rejected(const std::filesystem::path& step_dir, const std::string& message) {
  EXPECT_THAT([&] { read_checkpoint_index(step_dir); },
              ::testing::ThrowsMessage<UserError>(HasSubstr(message)));
  VerifyReport report = verify_checkpoint(step_dir);
  ASSERT_FALSE(report.ok());
  EXPECT_THAT(report.problems.front(), HasSubstr(message));
  std::vector<StateTensor> targets = {{"model/w", torch::zeros({8, 4})}};
  EXPECT_THROW(load_checkpoint(step_dir, targets, *single_process_communicator()), UserError);
}

TEST(CkptIndex, RejectsFileNamesWithDotDotOrAbsolutePaths) {
  for (const std::string name :
       {"../rank-0.safetensors", "/etc/passwd", "sub/rank-0.safetensors", "..", ""}) {
    TempDir dir;
    json index = make_checkpoint(dir.path());
    const std::string original = index["files"][0]["name"];
    index["files"][0]["name"] = name;
    for (auto& [tensor_name, tensor] : index["tensors"].items()) {
      for (auto& chunk : tensor["chunks"]) chunk["file"] = name;
    }
    rewrite_index(dir / "step-7", index);
    SCOPED_TRACE(name);
    expect_index_rejected(dir / "step-7", "is not a plain file name");
  }
}

TEST(CkptIndex, RejectsAChunkNamingAFileOutsideTheList) {
  TempDir dir;
  json index = make_checkpoint(dir.path());
  index["tensors"]["model/w"]["chunks"][0]["file"] = "../../secret";
  rewrite_index(dir / "step-7", index);
  expect_index_rejected(dir / "step-7", "is not listed in files");
}

TEST(CkptIndex, RejectsChunksThatOverlapMissOrLeaveTheTensor) {
  TempDir dir;
  const json good = make_checkpoint(dir.path());
  auto with = [&](const std::function<void(json&)>& edit, const std::string& message) {
    json index = good;
    edit(index["tensors"]["model/w"]);
    rewrite_index(dir / "step-7", index);
    SCOPED_TRACE(message);
    expect_index_rejected(dir / "step-7", message);
  };
  with([](json& t) { t["chunks"].push_back(t["chunks"][0]); }, "overlaps another chunk");
  with([](json& t) { t["shape"] = {9, 4}; }, "do not cover the whole tensor");
  with([](json& t) { t["chunks"][0]["offsets"] = {1, 0}; }, "extends outside the tensor");
  with(
      [](json& t) {
        t["chunks"][0]["byte_range"][1] = t["chunks"][0]["byte_range"][1].get<uint64_t>() + 4;
      },
      "does not match its sizes and dtype");
  with([](json& t) { t["dtype"] = "F99"; }, "unknown safetensors dtype");
  with([](json& t) { t["placement"] = "mirrored"; }, "neither \"replicated\" nor \"sharded\"");
}

TEST(CkptIndex, RejectsChecksumMismatchAndUnknownVersions) {
  TempDir dir;
  json index = make_checkpoint(dir.path());
  std::string text = read_file(dir / "step-7" / "index.json");
  text.replace(text.find("\"step\": 7"), 9, "\"step\": 8");
  write_file_atomic(dir / "step-7" / "index.json", text);
  expect_index_rejected(dir / "step-7", "index checksum mismatch");
  index["format_version"] = 99;
  rewrite_index(dir / "step-7", index);
  expect_index_rejected(dir / "step-7", "format_version 99 is not supported");
}

TEST(CkptIndex, HeaderThatDisagreesWithTheIndexIsCaught) {
  TempDir dir;
  json index = make_checkpoint(dir.path());
  // A valid file with the same size but other tensor names: the index's chunk is not there.
  const auto file = dir / "step-7" / "rank-0.safetensors";
  const auto old_size = std::filesystem::file_size(file);
  write_safetensors(file, {{"model/b", torch::randn({8})}, {"model/x", torch::randn({8, 4})}},
                    read_safetensors_header(file).metadata);
  ASSERT_EQ(std::filesystem::file_size(dir / "step-7" / "rank-0.safetensors"), old_size);
  index["files"][0]["xxh3"] = hex64(hash_file(dir / "step-7" / "rank-0.safetensors"));
  rewrite_index(dir / "step-7", index);
  VerifyReport report = verify_checkpoint(dir / "step-7");
  ASSERT_FALSE(report.ok());
  EXPECT_THAT(report.problems.front(), HasSubstr("has no tensor 'model/w'"));
  std::vector<StateTensor> targets = {{"model/w", torch::zeros({8, 4})}};
  EXPECT_THAT([&] { load_checkpoint(dir / "step-7", targets, *single_process_communicator()); },
              ::testing::ThrowsMessage<UserError>(HasSubstr("has no tensor 'model/w'")));
}

// Random edits of valid inputs: byte flips, truncations, insertions, and structured JSON edits
// (numbers replaced by extremes, keys dropped, types swapped). kFuzzCases cases (about 3 s on a
// 2-core build machine), case k drawn from seed kFuzzSeed + k, so a failure names the case and
// seed and KILN_FUZZ_CASE=k replays that case alone.
constexpr int64_t kFuzzCases = 40000;
constexpr uint64_t kFuzzSeed = 20241129;

TEST(CkptFuzz, ParsersRejectOrAcceptButNeverCrash) {
  TempDir dir;
  const json index = make_checkpoint(dir.path());
  const std::string index_text = index.dump();
  const std::string file_bytes = read_file(dir / "step-7" / "rank-0.safetensors");
  const uint64_t header_len = [&] {
    uint64_t n = 0;
    std::memcpy(&n, file_bytes.data(), 8);
    return n;
  }();
  std::mt19937_64 rng;
  const json extremes =
      json::array({-1, 0, 1, 18446744073709551615ull, 9223372036854775807ll, 1e308, "x", nullptr,
                   json::array(), json::object(), true, "../x", "/abs", 2147483648ull,
                   4611686018427387904ull, json::array({2147483648ull, 2147483648ull}), "F64"});
  auto mutate_bytes = [&](std::string s) {
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !s.empty(); ++e) {
      const size_t at = rng() % s.size();
      switch (rng() % 4) {
        case 0:
          s[at] = static_cast<char>(rng());
          break;
        case 1:
          s.resize(at);
          break;
        case 2:
          s.insert(at, 1, "{}[],:\"0-e9"[rng() % 11]);
          break;
        default:
          s.erase(at, 1 + rng() % 8);
          break;
      }
    }
    return s;
  };
  std::function<void(json&)> mutate_json = [&](json& j) {
    if (j.is_object() && !j.empty()) {
      auto it = j.begin();
      std::advance(it, static_cast<long>(rng() % j.size()));
      if (rng() % 5 == 0) {
        j.erase(it);
      } else {
        mutate_json(*it);
      }
    } else if (j.is_array() && !j.empty()) {
      mutate_json(j[rng() % j.size()]);
    } else {
      j = extremes[rng() % extremes.size()];
    }
  };
  int64_t first = 0, last = kFuzzCases;  // [first, last)
  if (const char* replay = std::getenv("KILN_FUZZ_CASE")) {
    first = std::stoll(replay);
    last = first + 1;
  }
  int64_t cases = 0, accepted = 0;
  for (int64_t c = first; c < last && !::testing::Test::HasFailure(); ++c) {
    const uint64_t seed = kFuzzSeed + static_cast<uint64_t>(c);
    rng.seed(seed);
    ++cases;
    SCOPED_TRACE("fuzz case " + std::to_string(c) + " of " + std::to_string(kFuzzCases) +
                 ", seed " + std::to_string(seed) + " (replay: KILN_FUZZ_CASE=" +
                 std::to_string(c) + " kiln_tests --gtest_filter=CkptFuzz.*)");
    // index.json: raw byte edits (caught by JSON or the checksum) and checksummed structural edits.
    std::string text;
    if (rng() % 2) {
      text = mutate_bytes(index_text);
    } else {
      json edited = index;
      for (int k = 0, n = 1 + static_cast<int>(rng() % 3); k < n; ++k) mutate_json(edited);
      text = edited.is_object() ? ckpt::index_text_with_checksum(edited) : edited.dump();
    }
    try {
      parse_checkpoint_index(text, "fuzz");
      ++accepted;
    } catch (const UserError&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << "index: not a UserError: " << e.what();
    }
    // safetensors: edits anywhere, or inside the header only.
    std::string bytes = file_bytes;
    const int how = static_cast<int>(rng() % 3);
    if (how == 0) {
      bytes = mutate_bytes(bytes);
    } else if (how == 1) {
      // Structural edits of the header JSON (shapes, dtypes and offsets set to extremes).
      json header = json::parse(file_bytes.substr(8, header_len));
      for (int k = 0, n = 1 + static_cast<int>(rng() % 3); k < n; ++k) mutate_json(header);
      const std::string text = header.dump();
      const uint64_t n = text.size();
      bytes = std::string(reinterpret_cast<const char*>(&n), 8) + text +
              file_bytes.substr(8 + header_len);
    } else {
      std::string header = mutate_bytes(file_bytes.substr(8, header_len));
      uint64_t n = header.size();
      bytes = std::string(reinterpret_cast<const char*>(&n), 8) + header +
              file_bytes.substr(8 + header_len);
    }
    try {
      const SafetensorsHeader header = parse_safetensors_header(bytes, bytes.size(), "fuzz");
      ++accepted;
      // What is accepted is consistent: each entry's byte range holds exactly its shape.
      for (const auto& entry : header.tensors) {
        unsigned __int128 need = c10::elementSize(entry.dtype);
        for (int64_t d : entry.shape) need *= static_cast<uint64_t>(d);
        ASSERT_EQ(need, static_cast<unsigned __int128>(entry.end - entry.begin)) << entry.name;
      }
    } catch (const UserError&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << "safetensors: not a UserError: " << e.what();
    }
  }
  std::cout << "[ fuzz ] " << cases << " cases (seeds " << kFuzzSeed + first << ".."
            << kFuzzSeed + last - 1 << "), " << accepted << " accepted\n";
  EXPECT_EQ(cases, last - first);
}

}  // namespace
}  // namespace kiln::testing
