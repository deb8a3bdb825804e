// `kiln data prepare`: tokenize text, directories and JSONL with a Hugging Face tokenizer.json
// into llm.c .bin shards + data.json, ready for data.name = "tokens" (docs/data.md).
#include <fmt/format.h>
#include <unistd.h>

#include <memory>

#include "cli/commands.h"
#include "core/strings.h"
#include "data/prepare.h"
#include "kiln/compile.h"

namespace kiln::cli {

namespace {

struct PrepareArgs {
  std::string tokenizer, out, field = "text", separator = "auto";
  std::vector<std::string> inputs, val_inputs;
  double val_fraction = 0.1;
  int64_t shard_tokens = 100'000'000;
};

int prepare_command(const PrepareArgs& args) {
  PrepareOptions options;
  options.tokenizer = args.tokenizer;
  options.out = args.out;
  options.inputs.assign(args.inputs.begin(), args.inputs.end());
  options.val_inputs.assign(args.val_inputs.begin(), args.val_inputs.end());
  options.field = args.field;
  options.val_fraction = args.val_fraction;
  options.shard_tokens = args.shard_tokens;
  options.separator = args.separator;
  options.progress = ::isatty(STDERR_FILENO) == 1;
  // The Python the compile step uses: compile.python's default, $KILN_PYTHON, the build's.
  options.python = CompileOptions::from_config(Config::defaults()).python;
  const PrepareResult result = prepare_corpus(options);
  const nlohmann::json& d = result.data_json;
  const nlohmann::json splits = d.value("splits", nlohmann::json::object());
  auto tokens = [&](const char* split) {
    return splits.contains(split) ? splits[split].value("tokens", int64_t{0}) : int64_t{0};
  };
  auto shards = [&](const char* split) {
    return splits.contains(split) ? splits[split].value("shards", nlohmann::json::array()).size()
                                  : size_t{0};
  };
  const int64_t total = tokens("train") + tokens("val");
  const std::string dir = std::filesystem::absolute(args.out).lexically_normal().string();
  if (result.up_to_date) {
    fmt::print("{} is up to date (same tokenizer, inputs and options): nothing written\n", dir);
  } else {
    fmt::print(
        "prepared {}: {} training tokens in {} shard(s), {} validation tokens in {}, {} "
        "from {} input file(s) in {} ({:.0f} tokens/s)\n",
        dir, tokens("train"), shards("train"), tokens("val"), shards("val"),
        d.value("token_dtype", "?"), d.value("inputs", nlohmann::json::array()).size(),
        format_duration(result.seconds),
        result.seconds > 0 ? static_cast<double>(total) / result.seconds : 0.0);
  }
  fmt::print("tokenizer vocabulary {} | train with --set data.name=tokens --set data.path={}\n",
             d.value("tokenizer", nlohmann::json::object()).value("vocab_size", int64_t{0}), dir);
  return 0;
}

void add_data_command(CLI::App& app, Action& action) {
  auto* data = app.add_subcommand("data", "prepare training data (tokenize text into .bin shards)");
  data->require_subcommand(1);
  auto* prepare = data->add_subcommand(
      "prepare",
      "tokenize text files, directories and JSONL with a Hugging Face tokenizer.json "
      "into llm.c .bin shards + data.json (docs/data.md)");
  auto args = std::make_shared<PrepareArgs>();
  prepare->add_option("inputs", args->inputs, "text files, JSONL files (.jsonl) or directories")
      ->required();
  prepare->add_option("--tokenizer", args->tokenizer, "a Hugging Face tokenizer.json")->required();
  prepare->add_option("--out", args->out, "the output directory (shards and data.json)")
      ->required();
  prepare
      ->add_option("--val", args->val_inputs,
                   "validation inputs (repeatable; default: the tail of the training tokens)")
      ->allow_extra_args(false);
  prepare
      ->add_option("--val-fraction", args->val_fraction,
                   "share of the training tokens held out for validation (without --val)")
      ->capture_default_str();
  prepare->add_option("--field", args->field, "JSONL: the key holding each document's text")
      ->capture_default_str();
  prepare->add_option("--shard-tokens", args->shard_tokens, "tokens per .bin shard")
      ->capture_default_str();
  prepare
      ->add_option("--separator", args->separator,
                   "token after each document: auto (<|endoftext|>, </s>, ... when the "
                   "tokenizer has one), none, or a token")
      ->capture_default_str();
  prepare->callback([&action, args] { action = [args] { return prepare_command(*args); }; });
}

const Registration data_registration{92, add_data_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
