// The layering of src/ and include/kiln/ (docs/architecture.md), checked from the #include lines:
// a component includes only components below it, core includes nothing above it, no component
// includes a rung, and no folder includes another folder's internal.h. And the configuration is
// read by key ("section.key") only in the schema and options files: logic takes typed options.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
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
    // models: a tensor-parallel layer sums its partial results over the tp group (the
    // Communicator interface only; process groups are built in dist).
    t["models"] = {"core", "comm", "models"};
    t["data"] = {"core", "models", "data"};
    t["train"] = {"core", "comm", "models", "data", "train"};
    for (const char* component : {"dist", "ckpt", "profile", "peer", "compile"}) {
      t[component] = {"core", "comm", "models", "data", "train", component};
    }
    // plan: reads model shapes, never builds a model; fills the plan's typed result (results).
    t["plan"] = {"core", "models", "results", "plan"};
    t["dist"].insert("plan");  // dist.strategy = "auto" asks the plan's rule
    // results: the typed rung files (kiln/results.h), just above core: rungs write them, the
    // renderers read them. report: the renderers (report.html, compare), reading run
    // directories through results alone; nothing below the rungs includes it.
    t["results"] = {"core", "results"};
    t["report"] = {"core", "results", "report"};
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
      {"optim.h", "train"},
      {"dist.h", "dist"},
      {"checkpoint.h", "ckpt"},
      // The safetensors format is data-only I/O any component may use (models reads Hugging Face
      // weights with it); its code is src/core/safetensors.cpp.
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
      {"job.h", "rungs"},
      {"hf.h", "models"},
      {"report.h", "report"},
      {"tensorboard.h", "train"},
      {"results.h", "results"}};
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

// Every quoted include under root/src and root/include/kiln.
std::vector<Include> all_includes(const fs::path& root) {
  std::vector<Include> out;
  for (const auto& entry : fs::recursive_directory_iterator(root / "src")) {
    if (!entry.is_regular_file()) continue;
    const fs::path rel = fs::relative(entry.path(), root / "src");
    if (rel.begin() == rel.end() || std::next(rel.begin()) == rel.end()) continue;  // src/pch.h
    for (auto& inc : quoted_includes(entry.path(), rel.begin()->string())) out.push_back(inc);
  }
  if (!fs::exists(root / "include" / "kiln")) return out;
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

// What breaks the layering among `includes`, one line each.
std::vector<std::string> layering_violations(const std::vector<Include>& includes) {
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
  return violations;
}

TEST(Layering, EveryIncludeFollowsTheLayers) {
  const auto includes = all_includes(KILN_SOURCE_DIR);
  ASSERT_GT(includes.size(), 100u) << "the scan found too few #include lines";
  for (const auto& v : layering_violations(includes)) ADD_FAILURE() << v;
}

// The negative control: a source tree with real bad includes, scanned and checked as src/ is.
TEST(Layering, TheCheckSeesAViolation) {
  const fs::path root = fs::temp_directory_path() / ("kiln-layering-" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto write = [&](const std::string& rel, const std::string& text) {
    fs::create_directories((root / rel).parent_path());
    std::ofstream(root / rel) << text;
  };
  write("src/core/ok.cpp", "#include \"core/strings.h\"\n#include <vector>\n");
  write("src/core/up.cpp", "#include \"kiln/train.h\"\n");          // core above itself
  write("src/ckpt/rung.cpp", "  #  include \"kiln/session.h\"\n");  // a component, a rung
  write("src/train/side.cpp", "#include \"dist/internal.h\"\n");    // another's internal.h
  write("src/nowhere/x.cpp", "#include \"core/strings.h\"\n");      // a folder not in the table
  write("include/kiln/train.h", "#include \"kiln/pilot.h\"\n");     // a public header
  const auto includes = all_includes(root);
  const std::vector<std::string> found = layering_violations(includes);
  fs::remove_all(root);
  ASSERT_EQ(includes.size(), 6u);
  auto seen = [&](const std::string& what) {
    return std::count_if(found.begin(), found.end(),
                         [&](const std::string& v) { return v.find(what) != std::string::npos; });
  };
  EXPECT_EQ(seen("up.cpp (core) includes kiln/train.h (train)"), 1);
  EXPECT_EQ(seen("rung.cpp (ckpt) includes kiln/session.h (rungs)"), 1);
  EXPECT_EQ(seen("side.cpp (train) includes dist/internal.h (dist)"), 1);
  EXPECT_EQ(seen("side.cpp includes another folder's dist/internal.h"), 1);
  EXPECT_EQ(seen("folder nowhere is not in the layering table"), 1);
  EXPECT_EQ(seen("include/kiln/train.h (train) includes kiln/pilot.h (rungs)"), 1);
  EXPECT_EQ(found.size(), 6u) << "ok.cpp's include is allowed";
}

// Each read of a Config by a literal key (config.get_int("train.steps")) in a file under
// root/src or root/include/kiln that is not a schema or options file: "file:line: text".
std::vector<std::string> keyed_config_reads(const fs::path& root) {
  static const std::regex read(
      R"(\.get_(string|int|bool|float|double|enum|table|float_table|string_list)\(\s*")");
  std::vector<std::string> out;
  for (const fs::path& dir : std::vector<fs::path>{root / "src", root / "include" / "kiln"}) {
    if (!fs::exists(dir)) continue;
    for (const auto& entry : fs::recursive_directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      if (!entry.is_regular_file() || name.find("schema") != std::string::npos ||
          name.find("options") != std::string::npos)
        continue;
      std::ifstream in(entry.path());
      std::string line;
      for (int n = 1; std::getline(in, line); ++n) {
        if (std::regex_search(line, read)) {
          out.push_back(fs::relative(entry.path(), root).string() + ":" + std::to_string(n) + ": " +
                        line);
        }
      }
    }
  }
  return out;
}

TEST(Layering, TheConfigIsReadByKeyOnlyInSchemaAndOptionsFiles) {
  for (const auto& read : keyed_config_reads(KILN_SOURCE_DIR)) {
    ADD_FAILURE() << read << "\n  read the key in the component's options file (a typed "
                  << "Options::from_config) and pass the value";
  }
}

// Its negative control: a tree with keyed reads in logic, and the same reads where allowed.
TEST(Layering, TheKeyedReadCheckSeesAReadInLogic) {
  const fs::path root =
      fs::temp_directory_path() / ("kiln-keyed-reads-" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto write = [&](const std::string& rel, const std::string& text) {
    fs::create_directories((root / rel).parent_path());
    std::ofstream(root / rel) << text;
  };
  const std::string read = "  const int64_t steps = config.get_int(\"train.steps\");\n";
  write("src/train/trainer.cpp", "// train.steps\n" + read);
  write("src/rungs/pilot.cpp", "x = c.get_string( \"run.dir\");\n");
  write("include/kiln/train.h", "inline bool f(const Config& c) { return c.get_bool(\"a.b\"); }\n");
  write("src/train/options.cpp", read);
  write("src/train/schema.cpp", read);
  write("src/train/pass.cpp", "config.get_int(key);  // a key passed in: not a literal\n");
  const std::vector<std::string> found = keyed_config_reads(root);
  fs::remove_all(root);
  ASSERT_EQ(found.size(), 3u);
  std::set<std::string> files;
  for (const auto& f : found) files.insert(f.substr(0, f.find(':')));
  EXPECT_EQ(files, (std::set<std::string>{"src/train/trainer.cpp", "src/rungs/pilot.cpp",
                                          "include/kiln/train.h"}));
  EXPECT_EQ(std::count_if(
                found.begin(), found.end(),
                [](const std::string& f) { return f.starts_with("src/train/trainer.cpp:2: "); }),
            1)
      << "names the file and line";
}

}  // namespace
