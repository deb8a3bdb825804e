// The datasets: a synthetic teacher task for the MLP and byte-level text; pre-tokenized files
// (nanoGPT and llm.c .bin, `kiln data prepare` directories) are in tokens.cpp.
#include <ATen/ATen.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/files.h"
#include "core/strings.h"
#include "data/tokens.h"
#include "kiln/config.h"
#include "kiln/data.h"
#include "kiln/dataset_registry.h"
#include "kiln/error.h"
#include "kiln/models.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const char* kDefaultCorpus = "/usr/share/games/fortunes";

// ---- synthetic: inputs ~ N(0, 1), labels from a fixed random teacher network -----------------

class TensorDataset final : public Dataset {
 public:
  TensorDataset(torch::Tensor inputs, torch::Tensor targets)
      : inputs_(std::move(inputs)), targets_(std::move(targets)) {}
  int64_t size() const override { return inputs_.size(0); }
  int64_t tokens_per_sample() const override { return 0; }
  Batch get(const std::vector<int64_t>& indices) const override {
    // Plain row copies: no ATen kernel (and so no OpenMP team) runs on loader threads.
    const int64_t batch = static_cast<int64_t>(indices.size()), dim = inputs_.size(1);
    auto inputs = torch::empty({batch, dim}, inputs_.options());
    auto targets = torch::empty({batch}, targets_.options());
    const float* in = inputs_.data_ptr<float>();
    const int64_t* labels = targets_.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      std::memcpy(inputs.data_ptr<float>() + b * dim, in + indices[b] * dim, sizeof(float) * dim);
      targets.data_ptr<int64_t>()[b] = labels[indices[b]];
    }
    return {inputs, targets};
  }

 private:
  torch::Tensor inputs_, targets_;  // [N, D] float32, [N] int64
};

Datasets make_synthetic(const DataSource& source) {
  const int64_t dim = source.input_dim;
  const int64_t classes = source.num_classes;
  const int64_t hidden = source.teacher_hidden;
  const uint64_t seed = source.seed;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  // The teacher: tanh(x W1 + b1) W2, argmax over classes. Fixed by the data seed.
  auto w1 = at::randn({dim, hidden}, generator) / std::sqrt(static_cast<double>(dim));
  auto b1 = at::randn({hidden}, generator) * 0.1;
  auto w2 = at::randn({hidden, classes}, generator) / std::sqrt(static_cast<double>(hidden));
  auto make = [&](int64_t count) {
    auto x = at::randn({count, dim}, generator);
    auto y = at::tanh(x.matmul(w1) + b1).matmul(w2).argmax(1);
    return std::make_shared<TensorDataset>(x.contiguous(), y.contiguous());
  };
  Datasets out;
  out.train = make(source.num_samples);
  out.val = make(source.val_samples);
  out.identity = {{"kind", "synthetic"},
                  {"generator", "teacher: argmax(tanh(x W1 + b1) W2), x ~ N(0, I)"},
                  {"input_dim", dim},
                  {"num_classes", classes},
                  {"teacher_hidden", hidden},
                  {"seed", seed},
                  {"train_samples", out.train->size()},
                  {"val_samples", out.val->size()}};
  return out;
}

// ---- text: any file (or a directory of text files) as bytes -------------------------------------

bool looks_binary(const std::string& bytes) {
  return bytes.find('\0') != std::string::npos;
}

Datasets make_text(const DataSource& source, int64_t vocab_limit) {
  std::string path = source.path;
  const bool default_corpus = path.empty();
  if (default_corpus) path = kDefaultCorpus;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    if (default_corpus) {
      throw UserError(std::string("data.path: the default corpus ") + kDefaultCorpus +
                      " is missing; install it with `apt-get install fortunes` (scripts/setup "
                      "does this) or set data.path to a text file");
    }
    throw UserError("data.path = \"" + path +
                    "\" does not exist; point it at a text file or directory");
  }
  // A directory: its regular files, sorted by name; files with NUL bytes (binary) are skipped.
  std::vector<fs::path> files;
  if (fs::is_directory(path, ec)) {
    for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
      if (it->is_regular_file(ec) && !it->is_symlink(ec)) files.push_back(it->path());
    }
    if (ec)
      throw UserError("data.path = \"" + path + "\": cannot list the directory: " + ec.message());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  auto bytes = std::make_shared<std::string>();
  json used = json::array();
  for (const auto& file : files) {
    std::string content = read_file(file);
    if (files.size() > 1 && looks_binary(content)) continue;
    *bytes += content;
    used.push_back(file.filename().string());
  }
  if (vocab_limit > 0 && vocab_limit < 256) {
    throw UserError(
        "model.vocab_size = " + std::to_string(vocab_limit) +
        " is smaller than the 256 byte values of data.name = \"text\"; set it to 256 or more");
  }
  TokenBuffer buffer;
  buffer.owner = bytes;
  buffer.data = reinterpret_cast<const uint8_t*>(bytes->data());
  buffer.count = static_cast<int64_t>(bytes->size());
  buffer.element_bytes = 1;
  buffer.source = path;
  const int64_t seq_len = source.seq_len;
  const int64_t val_count = static_cast<int64_t>(std::llround(source.val_fraction * buffer.count));
  const int64_t train_count = buffer.count - val_count;
  Datasets out;
  out.train = make_windows({{buffer, 0, train_count}}, seq_len, "train");
  out.val = make_windows({{buffer, train_count, val_count}}, seq_len, "validation");
  out.identity = {{"kind", "text"},
                  {"path", fs::absolute(path).string()},
                  {"files", used},
                  {"size_bytes", buffer.count},
                  {"content_xxh3", hex64(XXH3_64bits(bytes->data(), bytes->size()))},
                  {"tokenizer", "bytes (vocab 256)"},
                  {"train_tokens", train_count},
                  {"val_tokens", val_count},
                  {"train_samples", out.train->size()},
                  {"val_samples", out.val->size()}};
  return out;
}

}  // namespace

Datasets make_datasets(const Config& config) {
  const DataSource source = DataSource::from_config(config);
  const std::string& name = source.name;
  if (const DatasetSpec* spec = find_dataset(name)) {  // a program's own (kiln/dataset_registry.h)
    Datasets out = spec->build(config);
    if (!out.train || !out.val) {
      throw UserError("data.name = \"" + name + "\": the registered dataset built no " +
                      (out.train ? "validation" : "training") + " set");
    }
    if (!out.identity.is_object()) out.identity = nlohmann::json::object();
    if (!out.identity.contains("kind")) out.identity["kind"] = name;
    return out;
  }
  if (name == "synthetic") return make_synthetic(source);
  const int64_t vocab = model_vocab_size(config);  // 0 for a model without a vocabulary
  if (name == "text") return make_text(source, vocab);
  return make_tokens(source, vocab);
}

}  // namespace kiln
