// `kiln data prepare` and the token files it writes: tokenizers trained in the test on three
// fortunes files (tests/data/make_tokenizers.py, no downloads), one prepared corpus shared by
// the tests of a build (build/test-data/), bad input, and training on the result.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "kiln/build_info.h"
#include "kiln/data.h"
#include "kiln/error.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::HasSubstr;

std::string quote(const fs::path& path) {
  return "'" + path.string() + "'";
}

fs::path test_python() {
  return fs::path(KILN_TORCHRUN).parent_path() / "python";  // the project's .venv
}

std::string sha256sum(const fs::path& path) {
  return run_shell("sha256sum " + quote(path)).out.substr(0, 64);
}

// The shared fixture: build/test-data/{corpus/, tok/, prepared/}. Made once per build under a
// file lock; `kiln data prepare` runs again whenever prepare.py changed.
struct Corpus {
  fs::path root, corpus, tokenizer, wide_tokenizer, prepared;
  std::vector<int64_t> first_file_ids;  // plain Tokenizer.encode of corpus/art
  json data_json;
  CommandResult prepare;  // this use's `kiln data prepare`, if it ran
};

const Corpus& shared_corpus() {
  static const Corpus corpus = [] {
    Corpus c;
    c.root = fs::path(KILN_CLI).parent_path() / "test-data";
    fs::create_directories(c.root);
    c.corpus = c.root / "corpus";
    c.tokenizer = c.root / "tok" / "bpe.json";
    c.wide_tokenizer = c.root / "tok" / "wide.json";
    c.prepared = c.root / "prepared";
    {
      const FileLock lock(c.root / ".lock");
      if (!fs::exists(c.root / "tok" / "expected.json")) {
        fs::create_directories(c.corpus);
        std::string files;
        for (const char* name : {"art", "debian", "drugs"}) {
          fs::copy_file(fs::path("/usr/share/games/fortunes") / name, c.corpus / name,
                        fs::copy_options::overwrite_existing);
          files += " " + quote(c.corpus / name);
        }
        const CommandResult made =
            run_shell(quote(test_python()) + " " +
                      quote(source_dir() / "tests" / "data" / "make_tokenizers.py") + " " +
                      quote(c.root / "tok") + files);
        EXPECT_EQ(made.exit_code, 0) << made.err;
      }
      // Prepared already, by this very prepare.py? (Else prepare: it rewrites what changed.)
      bool current = false;
      c.prepare.exit_code = 0;
      if (fs::exists(c.prepared / "data.json")) {
        const json d = json::parse(slurp(c.prepared / "data.json"), nullptr, false);
        current =
            d.is_object() && d.value("recipe", json::object()).value("prepare_py_sha256", "") ==
                                 sha256sum(source_dir() / "python" / "kiln_py" / "prepare.py");
      }
      if (!current) {
        c.prepare = run_kiln("data prepare --tokenizer " + quote(c.tokenizer) + " --out " +
                             quote(c.prepared) + " --shard-tokens 20000 " + quote(c.corpus));
      }
    }
    EXPECT_EQ(c.prepare.exit_code, 0) << c.prepare.err;  // 0 when it did not run
    c.first_file_ids = json::parse(slurp(c.root / "tok" / "expected.json"))["bpe_first_file"]
                           .get<std::vector<int64_t>>();
    c.data_json = json::parse(slurp(c.prepared / "data.json"));
    return c;
  }();
  return corpus;
}

Config tokens_config(const fs::path& run_dir, const fs::path& data,
                     const std::vector<std::string>& extra = {}) {
  std::vector<std::string> o = {"data.name=tokens", "data.path=" + data.string(),
                                "model.vocab_size=512", "data.seq_len=32"};
  o.insert(o.end(), extra.begin(), extra.end());
  return gpt_config(run_dir, o);
}

std::vector<int64_t> row(const torch::Tensor& t) {
  auto c = t.contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

TEST(DataPrepare, ShardsHoldTheTokenizersIdsAndDataJsonDescribesThem) {
  const Corpus& c = shared_corpus();
  const json& d = c.data_json;
  EXPECT_EQ(d["tokenizer"]["sha256"], sha256sum(c.tokenizer));
  EXPECT_EQ(d["tokenizer"]["vocab_size"], 512);
  EXPECT_EQ(d["tokenizer"]["separator"]["token"], "<|endoftext|>");
  EXPECT_EQ(d["token_dtype"], "uint16");
  EXPECT_EQ(d["kiln_version"], build_info().version);
  ASSERT_EQ(d["inputs"].size(), 3u);
  int64_t input_tokens = 0;
  for (size_t k = 0; k < 3; ++k) {
    const json& input = d["inputs"][k];
    const fs::path path = c.corpus / std::vector<std::string>{"art", "debian", "drugs"}[k];
    EXPECT_EQ(input["path"], path.string());
    EXPECT_EQ(input["size_bytes"], fs::file_size(path));
    EXPECT_EQ(input["sha256"], sha256sum(path));
    input_tokens += input["tokens"].get<int64_t>();
  }
  // art: its plain encoding, then the separator.
  EXPECT_EQ(d["inputs"][0]["tokens"].get<size_t>(), c.first_file_ids.size() + 1);
  int64_t split_tokens = 0;
  for (const char* split : {"train", "val"}) {
    int64_t shard_tokens = 0;
    for (const json& shard : d["splits"][split]["shards"]) {
      EXPECT_EQ(shard["size_bytes"], fs::file_size(c.prepared / shard["file"].get<std::string>()));
      shard_tokens += shard["tokens"].get<int64_t>();
    }
    EXPECT_EQ(shard_tokens, d["splits"][split]["tokens"]);
    split_tokens += shard_tokens;
  }
  EXPECT_EQ(split_tokens, input_tokens);
  EXPECT_EQ(d["splits"]["val"]["tokens"].get<int64_t>(), (input_tokens + 5) / 10);  // 10%, rounded
  ASSERT_EQ(d["splits"]["train"]["shards"].size(), 4u);  // 20,000 tokens each

  // Read back as kiln trains on it: windows never cross shards; shard 1 starts at token 20,000.
  TempDir run;
  Datasets data = make_datasets(tokens_config(run.path(), c.prepared));
  const auto& ids = c.first_file_ids;
  EXPECT_EQ(row(data.train->get({0}).inputs), std::vector<int64_t>(ids.begin(), ids.begin() + 32));
  EXPECT_EQ(row(data.train->get({1}).targets),
            std::vector<int64_t>(ids.begin() + 33, ids.begin() + 65));
  const int64_t per_shard = (20000 - 1) / 32;
  EXPECT_EQ(row(data.train->get({per_shard}).inputs),
            std::vector<int64_t>(ids.begin() + 20000, ids.begin() + 20032));
  EXPECT_EQ(data.identity["prepared"]["revision"], d["revision"]);
  EXPECT_EQ(data.identity["prepared"]["tokenizer_sha256"], d["tokenizer"]["sha256"]);
  EXPECT_EQ(data.identity["files"].size(), 5u);  // 4 train shards + 1 validation shard
}

TEST(DataPrepare, RerunWithTheSameInputsWritesNothingAndSaysSo) {
  const Corpus& c = shared_corpus();
  std::map<std::string, int64_t> before;
  auto modified = [](const fs::path& p) {
    struct stat st{};
    ::stat(p.c_str(), &st);
    return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  };
  for (const auto& entry : fs::directory_iterator(c.prepared))
    before[entry.path().filename()] = modified(entry.path());
  const CommandResult again =
      run_kiln("data prepare --tokenizer " + quote(c.tokenizer) + " --out " + quote(c.prepared) +
               " --shard-tokens 20000 " + quote(c.corpus));
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_THAT(again.out, HasSubstr("is up to date (same tokenizer, inputs and options): nothing "
                                   "written"));
  std::map<std::string, int64_t> after;
  for (const auto& entry : fs::directory_iterator(c.prepared))
    after[entry.path().filename()] = modified(entry.path());
  EXPECT_EQ(before, after);
}

TEST(DataPrepare, JsonlWithAWideVocabularyWritesUint32Shards) {
  const Corpus& c = shared_corpus();
  TempDir dir;
  write_text(dir / "docs.jsonl",
             "{\"id\": 1, \"body\": \"w69998 w3 w65536 w7\"}\n\n{\"body\": \"w1 w2 w70001\"}\n");
  write_text(dir / "val.jsonl", "{\"body\": \"w5 w6 w7 w8\"}\n");
  const CommandResult r = run_kiln("data prepare --tokenizer " + quote(c.wide_tokenizer) +
                                   " --out " + quote(dir / "out") + " --field body --val " +
                                   quote(dir / "val.jsonl") + " " + quote(dir / "docs.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json d = json::parse(slurp(dir / "out" / "data.json"));
  EXPECT_EQ(d["token_dtype"], "uint32");
  EXPECT_EQ(d["inputs"][0]["documents"], 2);
  const std::string shard = slurp(dir / "out" / "train_000000.bin");
  int32_t header[3];
  std::memcpy(header, shard.data(), sizeof(header));
  EXPECT_EQ(header[0], 20240801);  // llm.c's uint32 (Llama 3) magic and version
  EXPECT_EQ(header[1], 7);
  EXPECT_EQ(header[2], 9);  // 4 + separator, 3 (w70001 is unknown: [UNK] = 0) + separator
  TempDir run;
  Datasets data = make_datasets(tokens_config(
      run.path(), dir / "out", {"model.vocab_size=70000", "data.seq_len=4", "data.shuffle=false"}));
  EXPECT_EQ(row(data.train->get({0}).inputs), (std::vector<int64_t>{69998, 3, 65536, 7}));
  EXPECT_EQ(row(data.train->get({1}).inputs), (std::vector<int64_t>{69999, 1, 2, 0}));
  EXPECT_EQ(row(data.val->get({0}).targets), (std::vector<int64_t>{6, 7, 8, 69999}));
  try {
    make_datasets(tokens_config(run.path(), dir / "out", {"model.vocab_size=60000"}));
    ADD_FAILURE() << "a model vocabulary smaller than the tokenizer's was accepted";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the model's vocabulary (60000 tokens) is smaller than the "
                                    "tokenizer's (70000 tokens"));
  }
}

TEST(DataPrepare, BadInputIsOneLineExitTwoAndWritesNothing) {
  const Corpus& c = shared_corpus();
  TempDir dir;
  write_text(dir / "garbage.json", "{\"model\": not a tokenizer");
  write_text(dir / "empty.txt", "");
  write_text(dir / "ok.txt", "a few words of text to tokenize, enough for a split\n");
  write_text(dir / "docs.jsonl",
             "{\"text\": \"one\"}\n{\"text\": \"two\"}\n{\"body\": \"three\"}\n");
  // Into a directory that does not exist (it is not created), and into a prepared one (a copy
  // of the shared corpus: left exactly as it was).
  fs::copy(c.prepared, dir / "prepared");
  std::map<std::string, std::string> before;
  for (const auto& entry : fs::directory_iterator(dir / "prepared"))
    before[entry.path().filename()] = slurp(entry.path());
  const std::string tok = " --tokenizer " + quote(c.tokenizer);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --out " + quote(dir / "out") + " --tokenizer " + quote(dir / "garbage.json") + " " +
           quote(dir / "ok.txt"),
       "garbage.json is not a Hugging Face tokenizer.json"},
      {" --out " + quote(dir / "out") + tok + " " + quote(dir / "empty.txt"), "empty.txt is empty"},
      {" --out " + quote(dir / "prepared") + tok + " " + quote(dir / "ok.txt") + " " +
           quote(dir / "docs.jsonl"),
       "docs.jsonl:3: no field \"text\" (it has: body)"},
  };
  for (const auto& [args, expected] : cases) {
    const CommandResult r = run_kiln("data prepare" + args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr(expected)) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_FALSE(fs::exists(dir / "out")) << args;
  }
  std::map<std::string, std::string> after;
  for (const auto& entry : fs::directory_iterator(dir / "prepared"))
    after[entry.path().filename()] = slurp(entry.path());
  EXPECT_TRUE(before == after) << "the prepared directory changed";
}

TEST(DataPrepare, AChangedOrUnfinishedDirectoryIsRefusedWhenOpened) {
  const Corpus& c = shared_corpus();
  TempDir dir;
  fs::copy(c.prepared, dir / "copy");
  auto error = [&](const fs::path& data) -> std::string {
    try {
      make_datasets(tokens_config(dir.path(), data));
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error(dir / "copy"), "");
  // A shard replaced by a shorter one: its header and data.json disagree.
  const std::string val = slurp(dir / "copy" / "val_000000.bin");
  std::string shorter = val.substr(0, val.size() - 2);
  const int32_t count = static_cast<int32_t>((shorter.size() - 1024) / 2);
  std::memcpy(shorter.data() + 8, &count, 4);
  write_text(dir / "copy" / "val_000000.bin", shorter);
  EXPECT_THAT(error(dir / "copy"), HasSubstr("but data.json lists"));
  write_text(dir / "copy" / "val_000000.bin", "not a token file");
  EXPECT_THAT(error(dir / "copy"), HasSubstr("truncated llm.c header"));
  // What an interrupted preparation leaves: shards without data.json.
  fs::remove(dir / "copy" / "data.json");
  EXPECT_THAT(error(dir / "copy"), HasSubstr("is a directory without data.json"));
}

TEST(DataPrepare, TrainsGptTinyOnThePreparedCorpusAndRecordsItsRevision) {
  const Corpus& c = shared_corpus();
  TempDir dir;
  const std::string common =
      "train " + quote(source_dir() / "configs" / "gpt-tiny.toml") +
      " --set run.dir=" + quote(dir.path()) + " --set run.progress=off --set data.name=tokens" +
      " --set data.path=" + quote(c.prepared) + " --set train.steps=3 --set train.eval_batches=2";
  const CommandResult small = run_kiln(common + " --set run.name=small");  // the preset's 256
  EXPECT_EQ(small.exit_code, 2) << small.out << small.err;
  EXPECT_THAT(small.err, HasSubstr("the model's vocabulary (256 tokens) is smaller than the "
                                   "tokenizer's (512 tokens"));
  EXPECT_EQ(std::count(small.err.begin(), small.err.end(), '\n'), 1) << small.err;
  const CommandResult r = run_kiln(common + " --set run.name=t --set model.vocab_size=512");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("trained 3 steps"));
  const json manifest = json::parse(slurp(dir / "t" / "manifest.json"));
  EXPECT_EQ(manifest["data"]["prepared"]["revision"], c.data_json["revision"]);
  EXPECT_EQ(manifest["data"]["revision"], c.data_json["revision"]);  // the data revision
  EXPECT_EQ(manifest["data"]["prepared"]["vocab_size"], 512);
}

// Issue 28: a token id beyond the vocabulary is found when the file is opened (one vectorised
// pass over the mapping, remembered by content hash), named by file and offset.
TEST(TokenData, ATokenBeyondTheVocabularyIsCaughtWhenTheFileIsOpened) {
  TempDir dir;
  ::setenv("KILN_HASH_CACHE", (dir / "hashes.json").c_str(), 1);
  std::vector<uint16_t> tokens(1000, 7);
  tokens[777] = 2000;
  int32_t header[256] = {20240520, 1, 1000};
  std::string bytes(reinterpret_cast<const char*>(header), sizeof(header));
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  write_text(dir / "bad.bin", bytes);
  const std::vector<std::string> o = {"data.name=tokens", "model.vocab_size=1000",
                                      "data.seq_len=10", "data.path=" + (dir / "bad.bin").string()};
  std::string message;
  try {
    make_datasets(gpt_config(dir.path(), o));  // no batch is drawn
  } catch (const UserError& e) {
    message = e.what();
  }
  EXPECT_THAT(message, HasSubstr("bad.bin: token id 2000 at token offset 777 (byte offset 2578) "
                                 "is outside the model's vocabulary (1000)"));
  // The scan's result is kept by content hash: a copy elsewhere is not scanned again (shown by
  // editing the remembered maximum), while different content is.
  const fs::path cache = dir / "hashes.json.token-max.json";
  json entries = json::parse(slurp(cache));
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries.begin().value(), 2000);
  entries.begin().value() = 0;
  write_text(cache, entries.dump());
  fs::copy_file(dir / "bad.bin", dir / "copy.bin");
  std::vector<std::string> copy = o;
  copy.back() = "data.path=" + (dir / "copy.bin").string();
  EXPECT_NO_THROW(make_datasets(gpt_config(dir.path(), copy)));
  EXPECT_EQ(json::parse(slurp(cache)).size(), 1u);
  ::unsetenv("KILN_HASH_CACHE");
}

}  // namespace
}  // namespace kiln::testing
