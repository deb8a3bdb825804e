// The layering of src/ and include/kiln/ (docs/architecture.md), checked from the #include lines:
// a component includes only components below it, core includes nothing above it, no component
// includes a rung, and no folder includes another folder's internal.h.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

// Each component and what it may include (itself included). Order is the layering, bottom up.
const std::map<std::string, std::set<std::string>>& allowed() {
  static const std::map<std::string, std::set<std::string>> table = [] {
    std::map<std::string, std::set<std::string>> t;
    t["core"] = {"core"};
    t["comm"] = {"core", "comm"};
    t["models"] = {"core", "models"};
    t["data"] = {"core", "models", "data"};
    t["train"] = {"core", "comm", "models", "data", "train"};
    for (const char* component : {"dist", "ckpt", "profile", "peer", "compile"}) {
      t[component] = {"core", "comm", "models", "data", "train", component};
    }
    t["peer"].insert("ckpt");                // the peer export writes safetensors
    t["plan"] = {"core", "models", "plan"};  // reads model shapes, never builds a model
    t["dist"].insert("plan");                // dist.strategy = "auto" asks the plan's rule
    // report: metrics sinks (TensorBoard) and report.html, above the Trainer it hooks into.
    t["report"] = {"core", "comm", "models", "data", "train", "report"};
    std::set<std::string> every;
    for (const auto& [name, deps] : t) every.insert(name);
    t["rungs"] = every;
    t["rungs"].insert("rungs");
    t["cli"] = t["rungs"];
    t["cli"].insert("cli");
    return t;
  }();
  return table;
}

// The component a public header belongs to.
std::string public_header_component(const std::string& name) {
  static const std::map<std::string, std::string> table = {
      {"config.h", "core"},
      {"error.h", "core"},
      {"log.h", "core"},
      {"run.h", "core"},
      {"build_info.h", "core"},
      {"comm.h", "comm"},
      {"models.h", "models"},
      {"data.h", "data"},
      {"dataset_registry.h", "data"},
      {"train.h", "train"},
      {"dist.h", "dist"},
      {"checkpoint.h", "ckpt"},
      // The safetensors format is data-only I/O any component may use (models reads Hugging Face
      // weights with it); its code lives in src/ckpt/.
      {"safetensors.h", "core"},
      {"profile.h", "profile"},
      {"peer.h", "peer"},
      {"compile.h", "compile"},
      {"plan.h", "plan"},
      {"pilot.h", "rungs"},
      {"memory.h", "profile"},
      {"session.h", "rungs"},
      {"rungs.h", "rungs"},
      {"training_run.h", "rungs"},
      {"hf.h", "models"},
      {"report.h", "report"},
      {"results.h", "report"}};
  auto it = table.find(name);
  return it == table.end() ? "" : it->second;
}

struct Include {
  fs::path file;
  std::string from;    // component of the including file
  std::string target;  // the quoted path
};

std::vector<Include> quoted_includes(const fs::path& file, const std::string& from) {
  static const std::regex pattern(R"(^\s*#\s*include\s*"([^"]+)\")");
  std::vector<Include> out;
  std::ifstream in(file);
  std::string line;
  std::smatch m;
  while (std::getline(in, line)) {
    if (std::regex_search(line, m, pattern)) out.push_back({file, from, m[1].str()});
  }
  return out;
}

std::vector<Include> all_includes() {
  const fs::path root = KILN_SOURCE_DIR;
  std::vector<Include> out;
  for (const auto& entry : fs::recursive_directory_iterator(root / "src")) {
    if (!entry.is_regular_file()) continue;
    const fs::path rel = fs::relative(entry.path(), root / "src");
    if (rel.begin() == rel.end() || std::next(rel.begin()) == rel.end()) continue;  // src/pch.h
    for (auto& inc : quoted_includes(entry.path(), rel.begin()->string())) out.push_back(inc);
  }
  for (const auto& entry : fs::directory_iterator(root / "include" / "kiln")) {
    const std::string component = public_header_component(entry.path().filename().string());
    for (auto& inc : quoted_includes(entry.path(), component)) out.push_back(inc);
  }
  return out;
}

// The component of an include target ("kiln/train.h", "ckpt/internal.h", "build_info.h").
std::string target_component(const std::string& target) {
  const auto slash = target.find('/');
  if (slash == std::string::npos) return target == "build_info.h" ? "core" : "";
  const std::string folder = target.substr(0, slash);
  if (folder == "kiln") return public_header_component(target.substr(slash + 1));
  return folder;
}

TEST(Layering, EveryIncludeFollowsTheLayers) {
  const auto includes = all_includes();
  ASSERT_GT(includes.size(), 100u) << "the scan found too few #include lines";
  std::vector<std::string> violations;
  for (const auto& inc : includes) {
    const std::string target = target_component(inc.target);
    if (inc.from.empty() || target.empty()) {
      violations.push_back(inc.file.string() + ": " + inc.target +
                           " is not in the layering table (tests/core/layering_test.cpp)");
      continue;
    }
    auto deps = allowed().find(inc.from);
    if (deps == allowed().end()) {
      violations.push_back(inc.file.string() + ": folder " + inc.from +
                           " is not in the layering table");
      continue;
    }
    if (!deps->second.count(target)) {
      violations.push_back(inc.file.string() + " (" + inc.from + ") includes " + inc.target + " (" +
                           target + ")");
    }
    if (inc.target.ends_with("/internal.h") && target != inc.from) {
      violations.push_back(inc.file.string() + " includes another folder's " + inc.target);
    }
  }
  for (const auto& v : violations) ADD_FAILURE() << v;
}

TEST(Layering, TheCheckSeesAViolation) {
  // The table itself: core may include nothing above it, a component no rung, and rungs no CLI.
  EXPECT_FALSE(allowed().at("core").count("train"));
  EXPECT_FALSE(allowed().at("ckpt").count("rungs"));
  EXPECT_FALSE(allowed().at("train").count("dist"));
  EXPECT_FALSE(allowed().at("rungs").count("cli"));
  EXPECT_EQ(target_component("kiln/session.h"), "rungs");
  EXPECT_EQ(target_component("ckpt/internal.h"), "ckpt");
}

}  // namespace
