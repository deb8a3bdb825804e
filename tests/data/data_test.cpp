#include "kiln/data.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <set>
#include <thread>

#include "kiln/error.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

std::vector<Batch> take(const Config& config, int workers, int count) {
  Datasets data = make_datasets(config);
  LoaderOptions options;
  options.batch_size = config.get_int("train.batch_size");
  options.num_workers = workers;
  options.prefetch = 3;
  options.seed = 5;
  Loader loader(data.train, options);
  std::vector<Batch> out;
  for (int k = 0; k < count; ++k) out.push_back(loader.next());
  return out;
}

TEST(Loader, BatchOrderDoesNotDependOnWorkerCount) {
  TempDir dir;
  for (const Config& config : {mlp_config(dir.path()), gpt_config(dir.path())}) {
    auto reference =
        take(config, 0, 70);  // the mlp's 2048 samples make 64 batches: crosses an epoch
    for (int workers : {1, 2, 4}) {
      auto batches = take(config, workers, 70);
      for (size_t k = 0; k < reference.size(); ++k) {
        EXPECT_TRUE(torch::equal(reference[k].inputs, batches[k].inputs))
            << workers << " workers, batch " << k;
        EXPECT_TRUE(torch::equal(reference[k].targets, batches[k].targets));
      }
    }
  }
}

// Batches 5 and 7 (shuffle off, batch size 4) fail; batch 5 is slow, so with workers batch 7
// usually fails first.
class FailingDataset : public Dataset {
 public:
  int64_t size() const override { return 400; }
  int64_t tokens_per_sample() const override { return 0; }
  Batch get(const std::vector<int64_t>& indices) const override {
    const int64_t batch = indices.front() / 4;
    if (batch == 5) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    if (batch == 5 || batch == 7) throw UserError("bad sample in batch " + std::to_string(batch));
    return {torch::full({4, 1}, static_cast<float>(batch)), torch::zeros({4}, torch::kLong)};
  }
};

TEST(Loader, AWorkerErrorSurfacesAtItsOwnBatchWhateverTheWorkerCount) {
  for (int workers : {0, 1, 2, 4}) {
    LoaderOptions options;
    options.batch_size = 4;
    options.num_workers = workers;
    options.prefetch = 4;
    options.shuffle = false;
    Loader loader(std::make_shared<FailingDataset>(), options);
    for (int k = 0; k < 5; ++k) {
      EXPECT_EQ(loader.next().inputs[0][0].item<float>(), static_cast<float>(k))
          << workers << " workers";
    }
    try {
      loader.next();
      ADD_FAILURE() << workers << " workers: batch 5 did not fail";
    } catch (const UserError& e) {
      EXPECT_THAT(e.what(), HasSubstr("batch 5")) << workers << " workers";
    }
  }
}

TEST(Loader, PositionAndSeekResumeTheSameStream) {
  TempDir dir;
  Config config =
      mlp_config(dir.path(), {"data.num_samples=256", "train.batch_size=32"});  // 8 batches/epoch
  Datasets data = make_datasets(config);
  LoaderOptions options;
  options.batch_size = 32;
  options.num_workers = 2;
  Loader a(data.train, options);
  std::vector<Batch> stream;
  for (int k = 0; k < 20; ++k) stream.push_back(a.next());
  Loader b(data.train, options);
  for (int k = 0; k < 11; ++k) b.next();
  EXPECT_EQ(b.position(), (LoaderPosition{1, 3}));
  Loader c(data.train, options);
  c.seek(b.position());
  for (int k = 11; k < 20; ++k) EXPECT_TRUE(torch::equal(c.next().inputs, stream[k].inputs)) << k;
}

TEST(Sampler, EpochIsAPermutationAndRanksAreDisjoint) {
  const int64_t n = 103, batch = 5, world = 3;  // 6 global batches per epoch, 13 samples left over
  std::set<int64_t> seen;
  for (int rank = 0; rank < world; ++rank) {
    Sampler sampler(n, batch, rank, world, /*shuffle=*/true, 42);
    ASSERT_EQ(sampler.batches_per_epoch(), 6);
    for (int64_t b = 0; b < sampler.batches_per_epoch(); ++b) {
      for (int64_t i : sampler.indices(0, b)) {
        EXPECT_TRUE(seen.insert(i).second) << "sample " << i << " drawn twice";
        EXPECT_LT(i, n);
      }
    }
  }
  EXPECT_EQ(seen.size(), 90u);
  Sampler s(n, batch, 0, 1, true, 42);
  EXPECT_NE(s.indices(0, 0), s.indices(1, 0));  // reshuffled each epoch
  EXPECT_EQ(s.indices(1, 0), Sampler(n, batch, 0, 1, true, 42).indices(1, 0));
}

TEST(Sampler, GlobalBatchIsTheSameSetAtAnyWorldSize) {
  Sampler one(64, 8, 0, 1, true, 3);
  const auto indices = one.indices(2, 1);
  std::set<int64_t> single(indices.begin(), indices.end());
  std::set<int64_t> pair;
  for (int rank = 0; rank < 2; ++rank) {
    for (int64_t i : Sampler(64, 4, rank, 2, true, 3).indices(2, 1)) pair.insert(i);
  }
  EXPECT_EQ(single, pair);
}

TEST(Sampler, TooLittleDataForOneGlobalBatchIsAUserError) {
  EXPECT_THROW(Sampler(10, 8, 0, 2, true, 0), UserError);
}

TEST(TextData, WindowsAreShiftedByOne) {
  TempDir dir;
  std::string text;
  for (int k = 0; k < 400; ++k) text += static_cast<char>('a' + k % 26);
  write_text(dir / "t.txt", text);
  Config config = gpt_config(dir.path(), {"data.path=" + (dir / "t.txt").string(), "data.seq_len=8",
                                          "data.val_fraction=0.25"});
  Datasets data = make_datasets(config);
  EXPECT_EQ(data.train->size(), (300 - 1) / 8);
  EXPECT_EQ(data.val->size(), (100 - 1) / 8);
  Batch b = data.train->get({0, 2});
  EXPECT_EQ(b.inputs.sizes(), (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(b.inputs[0][0].item<int64_t>(), 'a');
  EXPECT_EQ(b.targets[0][0].item<int64_t>(), 'b');
  EXPECT_EQ(b.inputs[1][0].item<int64_t>(), 'a' + 16);
  EXPECT_TRUE(torch::equal(b.inputs[0].slice(0, 1), b.targets[0].slice(0, 0, 7)));
}

TEST(TextData, MissingFileSaysWhatToDo) {
  TempDir dir;
  Config config = gpt_config(dir.path(), {"data.path=/nonexistent/corpus.txt"});
  try {
    make_datasets(config);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("/nonexistent/corpus.txt"));
  }
}

TEST(TextData, DefaultCorpusIsTheFortunesText) {
  TempDir dir;
  Datasets data = make_datasets(gpt_config(dir.path()));
  EXPECT_EQ(data.identity["path"], "/usr/share/games/fortunes");
  EXPECT_GT(data.identity["size_bytes"].get<int64_t>(), 1000000);
  for (const auto& f : data.identity["files"]) EXPECT_FALSE(f.get<std::string>().ends_with(".dat"));
}

// ---- token files ----

void write_llmc(const std::filesystem::path& path, const std::vector<uint16_t>& tokens,
                int32_t magic = 20240520, int32_t version = 1, int64_t declared = -1,
                size_t drop = 0) {
  int32_t header[256] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<int32_t>(declared >= 0 ? declared : static_cast<int64_t>(tokens.size()));
  std::string bytes(reinterpret_cast<const char*>(header), sizeof(header));
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size() - drop));
}

std::string token_error(const TempDir& dir, const std::vector<std::string>& extra) {
  std::vector<std::string> o = {"data.name=tokens", "model.vocab_size=1000"};
  o.insert(o.end(), extra.begin(), extra.end());
  try {
    Datasets d = make_datasets(gpt_config(dir.path(), o));
    d.train->get({0});
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(TokenData, ReadsLlmcAndNanogptFiles) {
  TempDir dir;
  std::vector<uint16_t> tokens(1000);
  for (size_t k = 0; k < tokens.size(); ++k) tokens[k] = static_cast<uint16_t>(k % 900);
  write_llmc(dir / "train.bin", tokens);
  write_text(dir / "raw.bin",
             std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2));
  for (auto [file, format] : {std::pair{"train.bin", "llmc"}, std::pair{"raw.bin", "nanogpt"}}) {
    Datasets d = make_datasets(gpt_config(
        dir.path(), {"data.name=tokens", "data.path=" + (dir / file).string(),
                     "model.vocab_size=1000", "data.seq_len=10", "data.val_fraction=0.1"}));
    EXPECT_EQ(d.identity["format"], format);
    EXPECT_EQ(d.train->size(), (900 - 1) / 10);
    Batch b = d.train->get({3});
    EXPECT_EQ(b.inputs[0][0].item<int64_t>(), 30);
    EXPECT_EQ(b.targets[0][9].item<int64_t>(), 40);
  }
}

TEST(TokenData, RejectsBadFilesWithClearErrors) {
  TempDir dir;
  std::vector<uint16_t> tokens(500, 7);
  write_llmc(dir / "magic.bin", tokens, 12345);
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "magic.bin").string(), "data.format=llmc"}),
              HasSubstr("bad magic 12345"));
  write_llmc(dir / "version.bin", tokens, 20240520, 7);
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "version.bin").string()}),
              HasSubstr("version 7"));
  write_llmc(dir / "trunc.bin", tokens, 20240520, 1, -1, 10);
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "trunc.bin").string()}),
              HasSubstr("header declares 500 tokens but the file holds 495"));
  write_text(dir / "short.bin", std::string(100, '\0'));
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "short.bin").string(), "data.format=llmc"}),
              HasSubstr("truncated llm.c header"));
  write_text(dir / "odd.bin", std::string(101, '\1'));
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "odd.bin").string()}),
              HasSubstr("not a whole number of uint16 tokens"));
  write_llmc(dir / "ok.bin", tokens);
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "ok.bin").string(), "data.seq_len=600",
                                "model.block_size=1024"}),
              HasSubstr("fewer than data.seq_len + 1"));
  std::vector<uint16_t> big(500, 60000);
  write_llmc(dir / "vocab.bin", big);
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "vocab.bin").string()}),
              HasSubstr("outside the model's vocabulary"));
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "nope.bin").string()}),
              HasSubstr("cannot be opened"));
  // An llm.c file forced to raw tokens would train on its header: refused, naming the format.
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "ok.bin").string(), "data.format=nanogpt"}),
              HasSubstr("data.format = \"nanogpt\" but the file is an llm.c token file (magic "
                        "20240520, 500 tokens"));
  // The control: the same file as llmc (or auto) opens; a raw file of the same tokens as nanogpt.
  EXPECT_EQ(token_error(dir, {"data.path=" + (dir / "ok.bin").string(), "data.format=llmc"}), "");
  // Text given as a token file: said to look like text, with the setting that reads it.
  write_text(dir / "README.md", "# A project\n\nSome prose that is not token ids at all.\n");
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "README.md").string()}),
              HasSubstr("it looks like text, not token ids: set data.name = \"text\""));
  write_text(dir / "README2.md", "# A project\n\nSome prose, an odd count!\n");
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "README2.md").string()}),
              HasSubstr("it looks like text"));
  EXPECT_THAT(token_error(dir, {"data.path=" + (dir / "odd.bin").string()}),
              ::testing::Not(HasSubstr("looks like text")));  // bytes of 1: not text
}

}  // namespace
}  // namespace kiln::testing
