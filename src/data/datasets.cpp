// The datasets: a synthetic teacher task for the MLP, byte-level text, and pre-tokenized files
// (nanoGPT raw uint16 .bin, llm.c .bin with a 256 x int32 header).
#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/files.h"
#include "core/pins.h"
#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/data.h"
#include "kiln/error.h"
#include "kiln/models.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int32_t kLlmcMagic = 20240520;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;
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

Datasets make_synthetic(const Config& config) {
  const int64_t dim = config.get_int("model.input_dim");
  const int64_t classes = config.get_int("model.num_classes");
  const int64_t hidden = config.get_int("data.teacher_hidden");
  const uint64_t seed = data_seed(config);
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
  out.train = make(config.get_int("data.num_samples"));
  out.val = make(config.get_int("data.val_samples"));
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

// ---- token windows over a byte/uint16 buffer ---------------------------------------------------

// Read-only token memory: a heap buffer (text) or a file mapping (token files).
struct TokenBuffer {
  std::shared_ptr<const void> owner;
  const uint8_t* data = nullptr;  // first token
  int64_t count = 0;              // tokens
  int element_bytes = 1;          // 1 (bytes) or 2 (uint16)
  std::string source;             // for error messages

  int64_t at(int64_t k) const {
    if (element_bytes == 1) return data[k];
    uint16_t v;
    std::memcpy(&v, data + 2 * k, 2);
    return v;
  }
};

// Sample i is the window [first + i*T, first + i*T + T + 1): inputs are its first T tokens,
// targets the last T (shifted by one).
class WindowDataset final : public Dataset {
 public:
  WindowDataset(TokenBuffer buffer, int64_t first, int64_t count, int64_t seq_len,
                int64_t vocab_limit)
      : buffer_(std::move(buffer)),
        first_(first),
        count_(count),
        seq_len_(seq_len),
        vocab_limit_(vocab_limit) {}
  int64_t size() const override { return (count_ - 1) / seq_len_; }
  int64_t tokens_per_sample() const override { return seq_len_; }
  Batch get(const std::vector<int64_t>& indices) const override {
    const int64_t batch = static_cast<int64_t>(indices.size());
    auto inputs = torch::empty({batch, seq_len_}, torch::kLong);
    auto targets = torch::empty({batch, seq_len_}, torch::kLong);
    int64_t* in = inputs.data_ptr<int64_t>();
    int64_t* out = targets.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t start = first_ + indices[b] * seq_len_;
      for (int64_t t = 0; t < seq_len_; ++t) {
        in[b * seq_len_ + t] = buffer_.at(start + t);
        out[b * seq_len_ + t] = buffer_.at(start + t + 1);
      }
    }
    if (vocab_limit_ > 0) {
      for (int64_t k = 0; k < batch * seq_len_; ++k) {
        if (in[k] >= vocab_limit_ || out[k] >= vocab_limit_) {
          throw UserError(buffer_.source + ": token id " + std::to_string(std::max(in[k], out[k])) +
                          " is outside the model's vocabulary (" + std::to_string(vocab_limit_) +
                          "); raise model.vocab_size or use matching token files");
        }
      }
    }
    return {inputs, targets};
  }

 private:
  TokenBuffer buffer_;
  int64_t first_, count_, seq_len_, vocab_limit_;
};

std::shared_ptr<const Dataset> make_windows(const TokenBuffer& buffer, int64_t first, int64_t count,
                                            int64_t seq_len, int64_t vocab_limit,
                                            const std::string& what) {
  if (count < seq_len + 1) {
    const std::string fix = what == "validation"
                                ? "raise data.val_fraction (or give data.val_path), lower "
                                  "data.seq_len, or use more data"
                                : "lower data.seq_len or data.val_fraction, or use more data";
    throw UserError(buffer.source + ": the " + what + " split holds " + std::to_string(count) +
                    " tokens, fewer than data.seq_len + 1 = " + std::to_string(seq_len + 1) + "; " +
                    fix);
  }
  return std::make_shared<WindowDataset>(buffer, first, count, seq_len, vocab_limit);
}

// ---- text: any file (or a directory of text files) as bytes -------------------------------------

bool looks_binary(const std::string& bytes) {
  return bytes.find('\0') != std::string::npos;
}

Datasets make_text(const Config& config, int64_t vocab_limit) {
  std::string path = config.get_string("data.path");
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
  const int64_t seq_len = config.get_int("data.seq_len");
  const int64_t val_count =
      static_cast<int64_t>(std::llround(config.get_float("data.val_fraction") * buffer.count));
  const int64_t train_count = buffer.count - val_count;
  Datasets out;
  out.train = make_windows(buffer, 0, train_count, seq_len, 0, "train");
  out.val = make_windows(buffer, train_count, val_count, seq_len, 0, "validation");
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

// ---- tokens: nanoGPT raw uint16 .bin, llm.c .bin -----------------------------------------------

TokenBuffer map_token_file(const std::string& path, const std::string& format_key,
                           std::string* format_used) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    throw UserError("token file " + path + " cannot be opened: " + std::strerror(errno) +
                    "; check data.path / data.val_path");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    throw UserError("token file " + path +
                    " is not a regular file; point data.path / data.val_path at a .bin file");
  }
  const int64_t size = st.st_size;
  void* map = size > 0
                  ? ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd.get(), 0)
                  : nullptr;
  fd.close();  // the mapping keeps the file
  if (size > 0 && map == MAP_FAILED) throw UserError("token file " + path + " cannot be mapped");
  std::shared_ptr<const void> owner(map, [size](const void* p) {
    if (p) ::munmap(const_cast<void*>(p), static_cast<size_t>(size));
  });
  const auto* bytes = static_cast<const uint8_t*>(map);
  int32_t magic = 0;
  if (size >= 4) std::memcpy(&magic, bytes, 4);
  std::string format = format_key;
  if (format == "auto")
    format = (size >= kLlmcHeaderBytes && magic == kLlmcMagic) ? "llmc" : "nanogpt";
  *format_used = format;
  TokenBuffer buffer;
  buffer.owner = owner;
  buffer.element_bytes = 2;
  buffer.source = path;
  if (format == "llmc") {
    if (size < kLlmcHeaderBytes) {
      throw UserError(path + ": truncated llm.c header (" + std::to_string(size) +
                      " bytes, the header alone is 1024)");
    }
    int32_t header[3];
    std::memcpy(header, bytes, sizeof(header));
    if (header[0] != kLlmcMagic) {
      throw UserError(path + ": bad magic " + std::to_string(header[0]) +
                      " (llm.c files start with " + std::to_string(kLlmcMagic) +
                      "); set data.format = \"nanogpt\" for raw uint16 files");
    }
    if (header[1] != 1) {
      throw UserError(path + ": llm.c token file version " + std::to_string(header[1]) +
                      " is not supported (version 1: uint16 tokens)");
    }
    const int64_t declared = header[2];
    const int64_t held = (size - kLlmcHeaderBytes) / 2;
    if (declared < 0 || size != kLlmcHeaderBytes + 2 * declared) {
      throw UserError(path + ": truncated or oversized: the header declares " +
                      std::to_string(declared) + " tokens but the file holds " +
                      std::to_string(held));
    }
    buffer.data = bytes + kLlmcHeaderBytes;
    buffer.count = declared;
  } else {
    if (size % 2 != 0) {
      throw UserError(path + ": " + std::to_string(size) +
                      " bytes is not a whole number of uint16 tokens (truncated file?)");
    }
    buffer.data = bytes;
    buffer.count = size / 2;
  }
  return buffer;
}

Datasets make_tokens(const Config& config, int64_t vocab_limit) {
  const std::string path = config.get_string("data.path");
  const std::string val_path = config.get_string("data.val_path");
  const int64_t seq_len = config.get_int("data.seq_len");
  std::string format;
  TokenBuffer train = map_token_file(path, config.get_string("data.format"), &format);
  Datasets out;
  json files = json::array();
  files.push_back({{"path", fs::absolute(path).string()},
                   {"size_bytes", fs::file_size(path)},
                   {"content_xxh3", hex64(hash_file_cached(path))},
                   {"tokens", train.count}});
  if (!val_path.empty()) {
    std::string val_format;
    TokenBuffer val = map_token_file(val_path, config.get_string("data.format"), &val_format);
    out.train = make_windows(train, 0, train.count, seq_len, vocab_limit, "train");
    out.val = make_windows(val, 0, val.count, seq_len, vocab_limit, "validation");
    files.push_back({{"path", fs::absolute(val_path).string()},
                     {"size_bytes", fs::file_size(val_path)},
                     {"content_xxh3", hex64(hash_file_cached(val_path))},
                     {"tokens", val.count}});
  } else {
    const int64_t val_count =
        static_cast<int64_t>(std::llround(config.get_float("data.val_fraction") * train.count));
    out.train = make_windows(train, 0, train.count - val_count, seq_len, vocab_limit, "train");
    out.val =
        make_windows(train, train.count - val_count, val_count, seq_len, vocab_limit, "validation");
  }
  out.identity = {{"kind", "tokens"},
                  {"format", format},
                  {"files", files},
                  {"train_samples", out.train->size()},
                  {"val_samples", out.val->size()}};
  return out;
}

}  // namespace

Datasets make_datasets(const Config& config) {
  const std::string& name = config.get_string("data.name");
  if (name == "synthetic") return make_synthetic(config);
  const int64_t vocab =
      config.get_string("model.name") == "gpt" ? resolve_gpt_config(config).vocab_size : 0;
  if (name == "text") return make_text(config, vocab);
  return make_tokens(config, vocab);
}

}  // namespace kiln
