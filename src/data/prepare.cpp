// `kiln data prepare` from C++: checks the options, hands them to python/kiln_py/prepare.py in a
// child process, and turns its result into a PrepareResult or a one-line UserError.
#include "data/prepare.h"

#include <fmt/format.h>

#include <filesystem>

#include "core/python_child.h"
#include "kiln/build_info.h"
#include "kiln/error.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

json paths_json(const std::vector<fs::path>& paths) {
  json out = json::array();
  for (const fs::path& p : paths) out.push_back(p.string());
  return out;
}

}  // namespace

PrepareResult prepare_corpus(const PrepareOptions& options) {
  if (options.inputs.empty())
    throw UserError("kiln data prepare needs at least one input (a text file, JSONL or directory)");
  if (!(options.val_fraction >= 0 && options.val_fraction <= 0.9)) {
    throw UserError(fmt::format("--val-fraction {} is outside [0, 0.9]", options.val_fraction));
  }
  if (options.val_fraction == 0 && options.val_inputs.empty()) {
    throw UserError(
        "--val-fraction 0 without --val leaves no validation split; set --val-fraction in (0, "
        "0.9] or give --val inputs");
  }
  if (options.shard_tokens < 1024)
    throw UserError(fmt::format("--shard-tokens {} is below 1024", options.shard_tokens));
  if (options.field.empty()) throw UserError("--field is empty; name the JSONL key holding text");
  if (options.python.empty()) throw UserError("kiln data prepare: no Python given");

  const json spec = {{"tokenizer", options.tokenizer.string()},
                     {"out", options.out.string()},
                     {"inputs", paths_json(options.inputs)},
                     {"val_inputs", paths_json(options.val_inputs)},
                     {"field", options.field},
                     {"val_fraction", options.val_fraction},
                     {"shard_tokens", options.shard_tokens},
                     {"separator", options.separator},
                     {"progress", options.progress},
                     {"kiln_version", build_info().version}};
  PythonChild child;
  child.python = options.python;
  child.module = "prepare";
  child.what = "kiln data prepare";
  child.ok_statuses = {"written", "up_to_date"};
  child.inherit_output = options.progress;
  child.python_hint = "the tokenizers library";
  const json result = run_python_child(child, spec);
  const std::string state = result.value("status", "");
  PrepareResult out;
  out.up_to_date = state == "up_to_date";
  out.seconds = result.value("seconds", 0.0);
  out.data_json = result.value("data_json", json::object());
  return out;
}

}  // namespace kiln
