// The status ranks exchange while a save is in flight: its wire form round-trips, malformed input
// is rejected with an error naming the rank, and the decision taken from a set of gathered
// statuses (no threads, no files).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "ckpt/saving.h"
#include "kiln/error.h"

namespace kiln::testing {
namespace {

using ckpt::SaveDecision;
using ckpt::SaveStatus;
using Kind = SaveStatus::Kind;
using Action = SaveDecision::Action;
using ::testing::HasSubstr;

const Kind kAllKinds[] = {Kind::kWriting,    Kind::kWritten,   Kind::kFailed,
                          Kind::kCommitting, Kind::kCommitted, Kind::kCommitFailed};

TEST(CkptSaveStatus, RoundTripsEveryKindMessageAndByteCount) {
  const std::string messages[] = {"",
                                  "plain",
                                  R"({"file":"rank-0.safetensors","ranges":{"a":[0,8]}})",
                                  "quote \" backslash \\ newline \n tab \t",
                                  std::string("nul \0 inside", 12),
                                  "ünïcödé ✓"};
  const uint64_t counts[] = {0, 1, 4096, std::numeric_limits<uint64_t>::max()};
  for (Kind kind : kAllKinds) {
    for (const auto& message : messages) {
      for (uint64_t bytes : counts) {
        const SaveStatus status{kind, message, bytes};
        const std::string wire = ckpt::encode_save_status(status);
        EXPECT_EQ(ckpt::decode_save_status(wire, 3), status)
            << ckpt::save_status_name(kind) << " " << wire;
      }
    }
  }
}

TEST(CkptSaveStatus, EachKindHasItsOwnName) {
  std::vector<std::string> names;
  for (Kind kind : kAllKinds) names.emplace_back(ckpt::save_status_name(kind));
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::unique(names.begin(), names.end()), names.end());
  EXPECT_THAT(ckpt::encode_save_status({Kind::kCommitFailed, "x", 0}),
              HasSubstr("\"commit_failed\""));
}

TEST(CkptSaveStatus, DecodeRejectsMalformedInputNamingTheRankAndTheProblem) {
  const std::pair<std::string, std::string> cases[] = {
      {"", "not JSON"},
      {"W", "not JSON"},  // the old one-letter protocol
      {"K4096", "not JSON"},
      {R"({"status":"written","message":"x","bytes":0)", "not JSON"},
      {"[]", "not a JSON object"},
      {"\"written\"", "not a JSON object"},
      {"{}", "'status' is missing"},
      {R"({"status":1,"message":"","bytes":0})", "'status' is missing or not a string"},
      {R"({"status":"paused","message":"","bytes":0})", "unknown status 'paused'"},
      {R"({"status":"WRITTEN","message":"","bytes":0})", "unknown status 'WRITTEN'"},
      {R"({"status":"written","bytes":0})", "'message' is missing"},
      {R"({"status":"written","message":7,"bytes":0})", "'message' is missing or not a string"},
      {R"({"status":"written","message":""})", "'bytes' is missing"},
      {R"({"status":"committed","message":"","bytes":-1})", "not an unsigned integer"},
      {R"({"status":"committed","message":"","bytes":1.5})", "not an unsigned integer"},
      {R"({"status":"committed","message":"","bytes":"8"})", "not an unsigned integer"},
      {R"({"status":"committed","message":"","bytes":0,"step":3})", "unknown field 'step'"},
  };
  for (const auto& [wire, problem] : cases) {
    try {
      ckpt::decode_save_status(wire, 5);
      ADD_FAILURE() << "accepted: " << wire;
    } catch (const UserError& e) {
      EXPECT_THAT(e.what(), HasSubstr("rank 5 sent a malformed save status")) << wire;
      EXPECT_THAT(e.what(), HasSubstr(problem)) << wire;
    }
  }
}

TEST(CkptSaveStatus, DecodeErrorQuotesAShortPrintableExcerpt) {
  const std::string wire = std::string("\x01\x02") + std::string(500, 'z');
  try {
    ckpt::decode_save_status(wire, 0);
    FAIL() << "accepted binary input";
  } catch (const UserError& e) {
    const std::string what = e.what();
    EXPECT_THAT(what, HasSubstr("'??zzz"));
    EXPECT_THAT(what, HasSubstr("...'"));
    EXPECT_LT(what.size(), 300u);
  }
}

SaveStatus writing() {
  return {Kind::kWriting, "", 0};
}
SaveStatus written(const std::string& info = "{}") {
  return {Kind::kWritten, info, 0};
}
SaveStatus failed(const std::string& why) {
  return {Kind::kFailed, why, 0};
}

TEST(CkptSaveDecision, WaitsWhileAnyRankWritesOrRankZeroCommits) {
  EXPECT_EQ(ckpt::decide_save({writing()}, 7).action, Action::kWait);
  EXPECT_EQ(ckpt::decide_save({written(), writing()}, 7).action, Action::kWait);
  EXPECT_EQ(ckpt::decide_save({writing(), written(), written()}, 7).action, Action::kWait);
  EXPECT_EQ(ckpt::decide_save({{Kind::kCommitting, "", 0}, written()}, 7).action, Action::kWait);
  // A failed rank waits for the others' writers to finish before the save resolves.
  EXPECT_EQ(ckpt::decide_save({failed("disk full"), writing()}, 7).action, Action::kWait);
}

TEST(CkptSaveDecision, CommitsOnceEveryRankHasWritten) {
  EXPECT_EQ(ckpt::decide_save({written()}, 7).action, Action::kCommit);
  const SaveDecision d = ckpt::decide_save({written(), written(), written()}, 7);
  EXPECT_EQ(d.action, Action::kCommit);
  EXPECT_EQ(d.error, "");
}

TEST(CkptSaveDecision, TheLowestFailedRankFailsTheSaveNamedWhenThereAreSeveral) {
  SaveDecision d = ckpt::decide_save({written(), failed("ENOSPC on rank-1"), failed("other")}, 7);
  EXPECT_EQ(d.action, Action::kFailed);
  EXPECT_EQ(d.error, "rank 1: ENOSPC on rank-1");
  d = ckpt::decide_save({failed("staging failed: x"), failed("y")}, 7);
  EXPECT_EQ(d.error, "rank 0: staging failed: x");
  d = ckpt::decide_save({failed("alone")}, 7);
  EXPECT_EQ(d.action, Action::kFailed);
  EXPECT_EQ(d.error, "alone");  // one rank: no rank prefix
}

TEST(CkptSaveDecision, RankZerosCommitOutcomeDecides) {
  SaveDecision d = ckpt::decide_save({{Kind::kCommitted, "", 123456789}, written()}, 7);
  EXPECT_EQ(d.action, Action::kCommitted);
  EXPECT_EQ(d.total_bytes, 123456789u);
  EXPECT_EQ(d.error, "");
  d = ckpt::decide_save({{Kind::kCommitFailed, "cannot rename a to b", 0}, written()}, 42);
  EXPECT_EQ(d.action, Action::kFailed);
  EXPECT_EQ(d.error, "commit of step 42 failed: cannot rename a to b");
  // Rank 0's outcome is final whatever another rank reports.
  EXPECT_EQ(ckpt::decide_save({{Kind::kCommitted, "", 1}, writing()}, 7).action,
            Action::kCommitted);
}

TEST(CkptSaveDecision, DecidesTheSameFromTheWireAsFromTheStatuses) {
  const std::vector<SaveStatus> statuses = {written(R"({"file":"rank-0.safetensors"})"),
                                            failed("rank 1 broke"), written()};
  std::vector<SaveStatus> decoded;
  for (size_t r = 0; r < statuses.size(); ++r) {
    decoded.push_back(
        ckpt::decode_save_status(ckpt::encode_save_status(statuses[r]), static_cast<int>(r)));
  }
  const SaveDecision a = ckpt::decide_save(statuses, 9), b = ckpt::decide_save(decoded, 9);
  EXPECT_EQ(a.action, b.action);
  EXPECT_EQ(a.error, b.error);
  EXPECT_EQ(b.error, "rank 1: rank 1 broke");
}

TEST(CkptSaveDecision, NoStatusesIsAnInternalError) {
  EXPECT_THROW(ckpt::decide_save({}, 7), UserError);
}

}  // namespace
}  // namespace kiln::testing
