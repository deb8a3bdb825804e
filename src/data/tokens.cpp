// Token windows and token files: nanoGPT raw uint16 .bin, llm.c .bin (a 256 x int32 header;
// uint16 tokens under magic 20240520 version 1, uint32 under llm.c's Llama 3 magic 20240801
// version 7) and directories written by `kiln data prepare` (data.json + llm.c shards).
#include "data/tokens.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/files.h"
#include "core/pins.h"
#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/data.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kLlmcHeaderBytes = 256 * 4;
struct LlmcKind {
  int32_t magic, version, element_bytes;
};
constexpr LlmcKind kLlmcKinds[] = {{20240520, 1, 2}, {20240801, 7, 4}};

// ---- windows -----------------------------------------------------------------------------------

class WindowDataset final : public Dataset {
 public:
  WindowDataset(std::vector<TokenSpan> spans, int64_t seq_len)
      : spans_(std::move(spans)), seq_len_(seq_len) {
    int64_t total = 0;
    for (const TokenSpan& span : spans_) {
      starts_.push_back(total);
      total += span.count > seq_len_ ? (span.count - 1) / seq_len_ : 0;
    }
    size_ = total;
  }
  int64_t size() const override { return size_; }
  int64_t tokens_per_sample() const override { return seq_len_; }
  Batch get(const std::vector<int64_t>& indices) const override {
    const int64_t batch = static_cast<int64_t>(indices.size());
    auto inputs = torch::empty({batch, seq_len_}, torch::kLong);
    auto targets = torch::empty({batch, seq_len_}, torch::kLong);
    int64_t* in = inputs.data_ptr<int64_t>();
    int64_t* out = targets.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      // The span holding sample indices[b]: the last whose first sample is <= it.
      const size_t s = static_cast<size_t>(
          std::upper_bound(starts_.begin(), starts_.end(), indices[b]) - starts_.begin() - 1);
      const TokenSpan& span = spans_[s];
      const int64_t start = span.first + (indices[b] - starts_[s]) * seq_len_;
      for (int64_t t = 0; t < seq_len_; ++t) {
        in[b * seq_len_ + t] = span.buffer.at(start + t);
        out[b * seq_len_ + t] = span.buffer.at(start + t + 1);
      }
    }
    return {inputs, targets};
  }

 private:
  std::vector<TokenSpan> spans_;
  std::vector<int64_t> starts_;  // first sample of each span
  int64_t seq_len_, size_ = 0;
};

// ---- token files -------------------------------------------------------------------------------

// "; it looks like text: ..." when the file's first 4 KiB are text (printable ASCII, whitespace
// or UTF-8 bytes, no NUL): a README given as data.path, not a token file.
std::string text_hint(const uint8_t* bytes, int64_t size) {
  const int64_t n = std::min<int64_t>(size, 4096);
  if (n == 0) return "";
  for (int64_t k = 0; k < n; ++k) {
    const uint8_t b = bytes[k];
    if (b < 0x20 && b != '\n' && b != '\r' && b != '\t') return "";
  }
  return "; it looks like text, not token ids: set data.name = \"text\" to train on it, or "
         "tokenize it with kiln data prepare";
}

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
  const LlmcKind* kind = nullptr;
  for (const LlmcKind& k : kLlmcKinds) {
    if (k.magic == magic) kind = &k;
  }
  std::string format = format_key;
  if (format == "auto") format = (size >= kLlmcHeaderBytes && kind) ? "llmc" : "nanogpt";
  if (format == "nanogpt" && kind && size >= kLlmcHeaderBytes) {
    // A whole llm.c file read as raw tokens would train on its header's 512 int32 as tokens.
    int32_t header[3];
    std::memcpy(header, bytes, sizeof(header));
    if (header[1] == kind->version && header[2] >= 0 &&
        size == kLlmcHeaderBytes + kind->element_bytes * static_cast<int64_t>(header[2])) {
      throw UserError(path +
                      ": data.format = \"nanogpt\" but the file is an llm.c token file (magic " +
                      std::to_string(kind->magic) + ", " + std::to_string(header[2]) +
                      " tokens after a 1024-byte header); set data.format = \"llmc\" or \"auto\"");
    }
  }
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
    if (!kind) {
      throw UserError(path + ": bad magic " + std::to_string(header[0]) +
                      " (llm.c files start with 20240520, uint16 tokens, or 20240801, uint32 "
                      "tokens); set data.format = \"nanogpt\" for raw uint16 files");
    }
    if (header[1] != kind->version) {
      throw UserError(path + ": llm.c token file version " + std::to_string(header[1]) +
                      " is not supported under magic " + std::to_string(kind->magic) +
                      " (version " + std::to_string(kind->version) + ": uint" +
                      std::to_string(8 * kind->element_bytes) + " tokens)");
    }
    buffer.element_bytes = kind->element_bytes;
    const int64_t declared = header[2];
    const int64_t held = (size - kLlmcHeaderBytes) / kind->element_bytes;
    if (declared < 0 || size != kLlmcHeaderBytes + kind->element_bytes * declared) {
      throw UserError(path + ": truncated or oversized: the header declares " +
                      std::to_string(declared) + " tokens but the file holds " +
                      std::to_string(held));
    }
    buffer.data = bytes + kLlmcHeaderBytes;
    buffer.count = declared;
  } else {
    if (size % 2 != 0) {
      throw UserError(path + ": " + std::to_string(size) +
                      " bytes is not a whole number of uint16 tokens (truncated file?)" +
                      text_hint(bytes, size));
    }
    buffer.data = bytes;
    buffer.count = size / 2;
    if (const std::string hint = text_hint(bytes, size); !hint.empty())
      log::warn(path + ": read as raw uint16 token ids (data.format = \"" + format_key + "\")" +
                hint);
  }
  return buffer;
}

// ---- the token range of a file, checked when it is opened ------------------------------------

// Beside the file-hash cache (core/pins.h: the same environment variables decide where).
fs::path token_range_cache_file() {
  if (const char* file = std::getenv("KILN_HASH_CACHE"); file && *file)
    return std::string(file) + ".token-max.json";
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
    return fs::path(xdg) / "kiln" / "token-max.json";
  if (const char* home = std::getenv("HOME"); home && *home)
    return fs::path(home) / ".cache" / "kiln" / "token-max.json";
  return {};
}

template <typename T>
int64_t max_of(const uint8_t* data, int64_t count) {
  // A plain reduction the compiler vectorises (pmaxuw / pmaxud at -O3).
  const T* tokens = reinterpret_cast<const T*>(data);
  T best = 0;
  for (int64_t k = 0; k < count; ++k) best = std::max(best, tokens[k]);
  return best;
}

int64_t max_token(const TokenBuffer& buffer) {
  if (buffer.count == 0) return -1;
  if (buffer.element_bytes == 2) return max_of<uint16_t>(buffer.data, buffer.count);
  if (buffer.element_bytes == 4) return max_of<uint32_t>(buffer.data, buffer.count);
  return max_of<uint8_t>(buffer.data, buffer.count);
}

// The largest token id of a whole file, remembered by its content hash (xxh3-64, itself cached by
// path, size and mtime): a large corpus is scanned once. The cache is advisory.
int64_t cached_max_token(const TokenBuffer& buffer, uint64_t content_xxh3) {
  // Everything that changes what is read: the content, the token width, where the tokens start
  // (an llm.c header, or none) and how many there are.
  const int64_t header = buffer.data - static_cast<const uint8_t*>(buffer.owner.get());
  const std::string key = hex64(content_xxh3) + "/uint" + std::to_string(8 * buffer.element_bytes) +
                          "@" + std::to_string(header) + "x" + std::to_string(buffer.count);
  const fs::path cache = token_range_cache_file();
  json entries = json::object();
  if (!cache.empty()) {
    std::ifstream in(cache);
    if (in) entries = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!entries.is_object()) entries = json::object();
    if (auto it = entries.find(key); it != entries.end() && it->is_number_integer())
      return it->get<int64_t>();
  }
  const int64_t max = max_token(buffer);
  if (!cache.empty()) {
    entries[key] = max;
    try {
      std::error_code ec;
      fs::create_directories(cache.parent_path(), ec);
      write_file_atomic(cache, entries.dump(1) + "\n");
    } catch (const std::exception&) {
      // advisory: the scan stands without the cache
    }
  }
  return max;
}

// Throws, naming the file and the first offending token's offset, when an id is >= vocab_limit.
void check_token_range(const TokenBuffer& buffer, uint64_t content_xxh3, int64_t vocab_limit) {
  if (vocab_limit <= 0 || cached_max_token(buffer, content_xxh3) < vocab_limit) return;
  int64_t k = 0;
  while (k < buffer.count && buffer.at(k) < vocab_limit) ++k;
  if (k == buffer.count) return;  // a stale cache entry: the file itself is in range
  const int64_t header = buffer.data - static_cast<const uint8_t*>(buffer.owner.get());
  throw UserError(buffer.source + ": token id " + std::to_string(buffer.at(k)) +
                  " at token offset " + std::to_string(k) + " (byte offset " +
                  std::to_string(header + k * buffer.element_bytes) +
                  ") is outside the model's vocabulary (" + std::to_string(vocab_limit) +
                  "); raise model.vocab_size or use token files made for this model" +
                  text_hint(static_cast<const uint8_t*>(buffer.owner.get()),
                            header + buffer.count * buffer.element_bytes));
}

// One token file: mapped, range-checked, and its identity for the manifest.
TokenBuffer open_token_file(const std::string& path, const std::string& format_key,
                            int64_t vocab_limit, std::string* format_used, json* files) {
  TokenBuffer buffer = map_token_file(path, format_key, format_used);
  const uint64_t hash = hash_file_cached(path);
  check_token_range(buffer, hash, vocab_limit);
  files->push_back({{"path", fs::absolute(path).string()},
                    {"size_bytes", fs::file_size(path)},
                    {"content_xxh3", hex64(hash)},
                    {"tokens", buffer.count}});
  return buffer;
}

// ---- directories written by `kiln data prepare` -----------------------------------------------

template <typename T>
T required(const json& object, const char* key, const fs::path& file) {
  if (!object.is_object() || !object.contains(key)) {
    throw UserError(file.string() + ": \"" + key +
                    "\" is missing; this is not a data.json written by kiln data prepare (re-run "
                    "it into this directory)");
  }
  try {
    return object.at(key).get<T>();
  } catch (const json::exception&) {
    throw UserError(file.string() + ": \"" + key +
                    "\" has the wrong type; re-run kiln data prepare");
  }
}

void check_vocabulary_fits(int64_t vocab, int64_t vocab_limit, const fs::path& manifest) {
  if (vocab_limit > 0 && vocab_limit < vocab) {
    throw UserError("the model's vocabulary (" + std::to_string(vocab_limit) +
                    " tokens) is smaller than the tokenizer's (" + std::to_string(vocab) +
                    " tokens, " + manifest.string() +
                    "); set model.vocab_size = " + std::to_string(vocab) + " or more");
  }
}

Datasets make_prepared(const DataSource& source, const fs::path& dir, int64_t vocab_limit) {
  const fs::path manifest = dir / "data.json";
  std::error_code ec;
  if (!fs::is_regular_file(manifest, ec)) {
    throw UserError("data.path = \"" + dir.string() +
                    "\" is a directory without data.json (an unfinished or interrupted kiln data "
                    "prepare?); run `kiln data prepare --tokenizer tokenizer.json --out " +
                    dir.string() + " <inputs>` or point data.path at a .bin file");
  }
  const std::string text = read_file(manifest);
  const json prepared = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (prepared.is_discarded() || !prepared.is_object()) {
    throw UserError(manifest.string() + " is not valid JSON; re-run kiln data prepare into " +
                    dir.string());
  }
  const json tokenizer = required<json>(prepared, "tokenizer", manifest);
  const int64_t vocab = required<int64_t>(tokenizer, "vocab_size", manifest);
  check_vocabulary_fits(vocab, vocab_limit, manifest);
  const json splits = required<json>(prepared, "splits", manifest);
  const int64_t seq_len = source.seq_len;
  json files = json::array();
  auto open_split = [&](const char* name) {
    std::vector<TokenSpan> spans;
    if (!splits.contains(name)) return spans;
    for (const json& shard : required<json>(splits.at(name), "shards", manifest)) {
      const fs::path path = dir / required<std::string>(shard, "file", manifest);
      std::string format;
      TokenBuffer buffer = open_token_file(path.string(), "llmc", vocab_limit, &format, &files);
      const int64_t listed = required<int64_t>(shard, "tokens", manifest);
      if (buffer.count != listed) {
        throw UserError(path.string() + " holds " + std::to_string(buffer.count) +
                        " tokens but data.json lists " + std::to_string(listed) +
                        ": the directory changed after it was prepared; re-run kiln data prepare");
      }
      spans.push_back({buffer, 0, buffer.count});
    }
    return spans;
  };
  Datasets out;
  out.train = make_windows(open_split("train"), seq_len, "train");
  const std::string val_path = source.val_path;
  if (!val_path.empty()) {
    std::string format;
    TokenBuffer val = open_token_file(val_path, source.format, vocab_limit, &format, &files);
    out.val = make_windows({{val, 0, val.count}}, seq_len, "validation");
  } else {
    std::vector<TokenSpan> val = open_split("val");
    if (val.empty()) {
      throw UserError(dir.string() +
                      " holds no validation split; re-run kiln data prepare with --val-fraction "
                      "or --val, or set data.val_path");
    }
    out.val = make_windows(std::move(val), seq_len, "validation");
  }
  out.identity = {{"kind", "tokens"},
                  {"format", "llmc"},
                  // The data revision of the manifest (unless data.revision names one).
                  {"revision", prepared.value("revision", json(nullptr))},
                  {"prepared",
                   {{"dir", fs::absolute(dir).lexically_normal().string()},
                    {"data_json_xxh3", hex64(XXH3_64bits(text.data(), text.size()))},
                    {"revision", prepared.value("revision", json(nullptr))},
                    {"kiln_version", prepared.value("kiln_version", json(nullptr))},
                    {"tokenizer_sha256", tokenizer.value("sha256", json(nullptr))},
                    {"vocab_size", vocab},
                    {"token_dtype", prepared.value("token_dtype", json(nullptr))}}},
                  {"files", files},
                  {"train_samples", out.train->size()},
                  {"val_samples", out.val->size()}};
  return out;
}

}  // namespace

std::shared_ptr<const Dataset> make_windows(std::vector<TokenSpan> spans, int64_t seq_len,
                                            const std::string& what) {
  int64_t total = 0, longest = 0;
  for (const TokenSpan& span : spans) {
    total += span.count;
    longest = std::max(longest, span.count);
  }
  if (longest < seq_len + 1) {
    const std::string fix = what == "validation"
                                ? "raise data.val_fraction (or give data.val_path), lower "
                                  "data.seq_len, or use more data"
                                : "lower data.seq_len or data.val_fraction, or use more data";
    const std::string source =
        spans.empty() ? std::string("the data") : spans.front().buffer.source;
    throw UserError(
        source + ": the " + what + " split holds " + std::to_string(total) + " tokens" +
        (spans.size() > 1 ? " (the longest shard " + std::to_string(longest) + ")" : "") +
        ", fewer than data.seq_len + 1 = " + std::to_string(seq_len + 1) + "; " + fix);
  }
  return std::make_shared<WindowDataset>(std::move(spans), seq_len);
}

Datasets make_tokens(const DataSource& source, int64_t vocab_limit) {
  const std::string path = source.path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return make_prepared(source, path, vocab_limit);
  const std::string val_path = source.val_path;
  const int64_t seq_len = source.seq_len;
  std::string format;
  json files = json::array();
  TokenBuffer train = open_token_file(path, source.format, vocab_limit, &format, &files);
  Datasets out;
  if (!val_path.empty()) {
    std::string val_format;
    TokenBuffer val = open_token_file(val_path, source.format, vocab_limit, &val_format, &files);
    out.train = make_windows({{train, 0, train.count}}, seq_len, "train");
    out.val = make_windows({{val, 0, val.count}}, seq_len, "validation");
  } else {
    const int64_t val_count = static_cast<int64_t>(std::llround(source.val_fraction * train.count));
    out.train = make_windows({{train, 0, train.count - val_count}}, seq_len, "train");
    out.val = make_windows({{train, train.count - val_count, val_count}}, seq_len, "validation");
  }
  out.identity = {{"kind", "tokens"},
                  {"format", format},
                  {"files", files},
                  {"train_samples", out.train->size()},
                  {"val_samples", out.val->size()}};
  return out;
}

void check_prepared_vocabulary(const fs::path& dir, int64_t vocab_limit) {
  const fs::path manifest = dir / "data.json";
  std::error_code ec;
  if (vocab_limit <= 0 || !fs::is_regular_file(manifest, ec)) return;  // make_tokens says why
  const json prepared = json::parse(read_file(manifest), nullptr, /*allow_exceptions=*/false);
  if (!prepared.is_object() || !prepared.contains("tokenizer")) return;
  const json& tokenizer = prepared["tokenizer"];
  if (!tokenizer.is_object() || !tokenizer.contains("vocab_size") ||
      !tokenizer["vocab_size"].is_number_integer())
    return;
  check_vocabulary_fits(tokenizer["vocab_size"].get<int64_t>(), vocab_limit, manifest);
}

}  // namespace kiln
