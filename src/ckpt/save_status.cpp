// The status each rank reports while a save is in flight, its wire form, and the decision every
// rank takes from the gathered statuses.
#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "ckpt/saving.h"
#include "kiln/error.h"

namespace kiln::ckpt {
namespace {

using nlohmann::json;
using Kind = SaveStatus::Kind;

constexpr std::array<std::pair<Kind, std::string_view>, 6> kNames = {{
    {Kind::kWriting, "writing"},
    {Kind::kWritten, "written"},
    {Kind::kFailed, "failed"},
    {Kind::kCommitting, "committing"},
    {Kind::kCommitted, "committed"},
    {Kind::kCommitFailed, "commit_failed"},
}};

// At most `limit` bytes of `bytes`, printable, for an error message.
std::string excerpt(std::string_view bytes, size_t limit = 80) {
  std::string out;
  for (size_t k = 0; k < std::min(bytes.size(), limit); ++k) {
    const auto c = static_cast<unsigned char>(bytes[k]);
    out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  if (bytes.size() > limit) out += "...";
  return out;
}

}  // namespace

std::string_view save_status_name(Kind kind) {
  for (const auto& [k, name] : kNames) {
    if (k == kind) return name;
  }
  throw UserError("checkpoint: internal error: unknown save status " +
                  std::to_string(static_cast<int>(kind)));
}

std::string encode_save_status(const SaveStatus& status) {
  return json{{"status", save_status_name(status.kind)},
              {"message", status.message},
              {"bytes", status.bytes}}
      .dump();
}

SaveStatus decode_save_status(std::string_view bytes, int rank) {
  auto fail = [&](const std::string& why) {
    return UserError(fmt::format(
        "checkpoint: rank {} sent a malformed save status ({}): '{}'; every rank must run the same "
        "kiln build",
        rank, why, excerpt(bytes)));
  };
  json j;
  try {
    j = json::parse(bytes);
  } catch (const json::exception&) {
    throw fail("not JSON");
  }
  if (!j.is_object()) throw fail("not a JSON object");
  for (const auto& [key, value] : j.items()) {
    if (key != "status" && key != "message" && key != "bytes")
      throw fail("unknown field '" + key + "'");
  }
  if (!j.contains("status") || !j["status"].is_string())
    throw fail("'status' is missing or not a string");
  if (!j.contains("message") || !j["message"].is_string())
    throw fail("'message' is missing or not a string");
  if (!j.contains("bytes") || !j["bytes"].is_number_unsigned())
    throw fail("'bytes' is missing or not an unsigned integer");
  SaveStatus status;
  const std::string name = j["status"].get<std::string>();
  const auto it = std::find_if(kNames.begin(), kNames.end(),
                               [&](const auto& entry) { return entry.second == name; });
  if (it == kNames.end()) throw fail("unknown status '" + name + "'");
  status.kind = it->first;
  status.message = j["message"].get<std::string>();
  status.bytes = j["bytes"].get<uint64_t>();
  return status;
}

SaveDecision decide_save(const std::vector<SaveStatus>& statuses, int64_t step) {
  if (statuses.empty()) throw UserError("checkpoint: internal error: no save statuses gathered");
  const SaveStatus& rank0 = statuses[0];
  if (rank0.kind == Kind::kCommitted) {
    return {SaveDecision::Action::kCommitted, "", rank0.bytes};
  }
  if (rank0.kind == Kind::kCommitFailed) {
    return {SaveDecision::Action::kFailed,
            "commit of step " + std::to_string(step) + " failed: " + rank0.message, 0};
  }
  const bool waiting = rank0.kind == Kind::kCommitting ||
                       std::any_of(statuses.begin(), statuses.end(),
                                   [](const SaveStatus& s) { return s.kind == Kind::kWriting; });
  if (waiting) return {SaveDecision::Action::kWait, "", 0};
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (statuses[r].kind == Kind::kFailed) {
      return {SaveDecision::Action::kFailed,
              (statuses.size() > 1 ? "rank " + std::to_string(r) + ": " : std::string()) +
                  statuses[r].message,
              0};
    }
  }
  return {SaveDecision::Action::kCommit, "", 0};
}

}  // namespace kiln::ckpt
