// The checkpoint library: the commit protocol, async staging, retention, per-rank parallel writes,
// resharding across world sizes, sharded reads of only the overlapping bytes, and loads that never
// touch the live state unless everything verified. Multi-rank cases use thread-backed ranks.
#include "kiln/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include "ckpt/ckpt_helpers.h"
#include "ckpt/thread_comm.h"
#include "core/files.h"
#include "kiln/error.h"
#include "kiln/safetensors.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

// A replicated "model" of a few tensors, the same on every rank (seeded).
std::vector<StateTensor> replicated_state(uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  std::vector<StateTensor> out;
  out.push_back({"model/a.weight", torch::randn({64, 32}, gen)});
  out.push_back({"model/a.bias", torch::randn({64}, gen)});
  out.push_back({"model/b.weight", torch::randn({16, 64}, gen).to(torch::kBFloat16)});
  out.push_back({"optim/steps", torch::tensor(int64_t{7})});
  out.push_back({"model/empty", torch::empty({0, 3})});
  out.push_back({"model/c.weight", torch::randn({128, 8}, gen)});
  return out;
}

// A [rows, cols] float tensor whose element (i, j) is i * cols + j.
torch::Tensor iota(int64_t rows, int64_t cols) {
  return torch::arange(rows * cols, torch::kFloat).view({rows, cols});
}

// Rank r's piece of `whole`, split along `dim` into `world` nearly equal parts.
StateTensor shard_of(const std::string& name, const torch::Tensor& whole, int64_t dim, int rank,
                     int world) {
  const int64_t n = whole.size(dim), per = (n + world - 1) / world;
  const int64_t begin = std::min<int64_t>(n, per * rank), end = std::min<int64_t>(n, begin + per);
  StateTensor t;
  t.name = name;
  t.tensor = whole.narrow(dim, begin, end - begin).clone();
  t.placement = Placement::kSharded;
  t.global_shape.assign(whole.sizes().begin(), whole.sizes().end());
  t.offsets.assign(whole.dim(), 0);
  t.offsets[static_cast<size_t>(dim)] = begin;
  return t;
}

std::vector<StateTensor> empty_like(const std::vector<StateTensor>& state) {
  std::vector<StateTensor> out = state;
  for (auto& t : out) t.tensor = torch::full_like(t.tensor, 0);
  return out;
}

void expect_same(const std::vector<StateTensor>& a, const std::vector<StateTensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_EQ(a[k].name, b[k].name);
    EXPECT_TRUE(torch::equal(a[k].tensor, b[k].tensor)) << a[k].name;
  }
}

SaveRequest request(int64_t step, std::vector<StateTensor> tensors) {
  SaveRequest r;
  r.step = step;
  r.tensors = std::move(tensors);
  r.training_state = {{"step", step}};
  return r;
}

CheckpointOptions options_for(const std::filesystem::path& dir, bool async) {
  CheckpointOptions o;
  o.dir = dir;
  o.async = async;
  return o;
}

class CkptSaveLoad : public ::testing::TestWithParam<bool> {};

TEST_P(CkptSaveLoad, RoundTripsAndCommitsAtomically) {
  TempDir dir;
  auto comm = single_process_communicator();
  auto state = replicated_state(1);
  {
    Checkpointer checkpointer(options_for(dir.path(), GetParam()), *comm);
    auto handle = checkpointer.save(request(5, state));
    checkpointer.wait();
    ASSERT_TRUE(handle->committed()) << handle->error();
    EXPECT_GT(handle->stats().total_bytes, 0u);
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "step-5" / "index.json"));
  EXPECT_TRUE(std::filesystem::exists(dir / "step-5" / "rank-0.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir / "step-5.tmp"));
  EXPECT_EQ(slurp(dir / "latest"), "step-5\n");
  VerifyReport report = verify_checkpoint(dir / "step-5");
  EXPECT_TRUE(report.ok()) << report.problems.front();
  CheckpointIndex index = read_checkpoint_index(dir / "step-5");
  EXPECT_EQ(index.step, 5);
  EXPECT_EQ(index.world_size, 1);
  EXPECT_EQ(index.training_state["step"], 5);

  auto loaded = empty_like(state);
  LoadResult result = load_checkpoint(dir / "step-5", loaded, *comm);
  expect_same(state, loaded);
  EXPECT_EQ(result.index.step, 5);
}

INSTANTIATE_TEST_SUITE_P(SyncAndAsync, CkptSaveLoad, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Async" : "Sync"; });

TEST(Ckpt, AsyncSaveStagesRealCopies) {
  TempDir dir;
  auto comm = single_process_communicator();
  auto state = replicated_state(2);
  auto before = state[0].tensor.clone();
  Checkpointer checkpointer(options_for(dir.path(), /*async=*/true), *comm);
  auto handle = checkpointer.save(request(1, state));
  state[0].tensor.add_(1.0);  // training goes on while the save is written
  checkpointer.wait();
  ASSERT_TRUE(handle->committed());
  auto loaded = empty_like(state);
  load_checkpoint(dir / "step-1", loaded, *comm);
  EXPECT_TRUE(torch::equal(loaded[0].tensor, before));
}

TEST(Ckpt, BackgroundStagingCopiesBeforeTheFenceReturns) {
  TempDir dir;
  auto comm = single_process_communicator();
  auto state = replicated_state(2);
  std::vector<torch::Tensor> before;
  for (const auto& t : state) before.push_back(t.tensor.clone());
  CheckpointOptions options = options_for(dir.path(), /*async=*/true);
  options.background_staging = true;
  Checkpointer checkpointer(options, *comm);
  for (int64_t step = 1; step <= 2; ++step) {  // the second save reuses the staging buffers
    auto handle = checkpointer.save(request(step, state));
    checkpointer.wait_for_staging();
    for (auto& t : state) t.tensor.add_(1);  // the optimizer step, after the fence
    checkpointer.wait();
    ASSERT_TRUE(handle->committed()) << handle->error();
    // Background staging is timed in the writer thread and reported in the handle.
    EXPECT_GT(handle->stats().staging_seconds, 0.0);
    EXPECT_LE(handle->stats().staging_seconds, handle->stats().total_seconds);
    auto loaded = empty_like(state);
    load_checkpoint(dir / ("step-" + std::to_string(step)), loaded, *comm);
    for (size_t k = 0; k < state.size(); ++k) {
      EXPECT_TRUE(torch::equal(loaded[k].tensor, before[k] + (step - 1))) << state[k].name;
    }
  }
  EXPECT_EQ(checkpointer.wait_for_staging(), 0.0);  // nothing in flight
}

TEST(Ckpt, AtMostOneSaveInFlight) {
  TempDir dir;
  auto comm = single_process_communicator();
  Checkpointer checkpointer(options_for(dir.path(), /*async=*/true), *comm);
  auto first = checkpointer.save(request(1, replicated_state(1)));
  auto second = checkpointer.save(request(2, replicated_state(2)));
  EXPECT_TRUE(first->finished());  // the second save waited for it
  EXPECT_TRUE(first->committed());
  EXPECT_TRUE(checkpointer.in_flight());
  checkpointer.wait();
  EXPECT_TRUE(second->committed());
  EXPECT_FALSE(checkpointer.in_flight());
}

// In a one-process world there is no exchange to wait for: the writer thread commits as soon as
// its file is durable, so a run's last save commits while its final evaluation runs, not in the
// wait after it. The training thread learns of it at its next poll or wait.
TEST(Ckpt, AOneProcessAsyncSaveCommitsWithoutWaitingForAPoll) {
  TempDir dir;
  auto comm = single_process_communicator();
  CheckpointOptions options = options_for(dir.path(), /*async=*/true);
  options.background_staging = true;
  Checkpointer checkpointer(options, *comm);
  auto handle = checkpointer.save(request(1, replicated_state(1)));
  // No poll, no wait: only the writer thread can publish step-1 and latest.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!std::filesystem::exists(dir / "latest") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_TRUE(std::filesystem::exists(dir / "latest")) << "not committed without a poll";
  EXPECT_TRUE(std::filesystem::exists(dir / "step-1" / "index.json"));
  EXPECT_FALSE(handle->finished());  // resolved by the training thread, at its next poll or wait
  EXPECT_TRUE(checkpointer.in_flight());
  checkpointer.wait();
  EXPECT_TRUE(handle->committed()) << handle->error();
  EXPECT_FALSE(checkpointer.in_flight());
  EXPECT_TRUE(verify_checkpoint(dir / "step-1").ok());
}

TEST(Ckpt, RetentionKeepsLastKAndKeepEvery) {
  TempDir dir;
  auto comm = single_process_communicator();
  CheckpointOptions options = options_for(dir.path(), /*async=*/true);
  options.keep_last_k = 2;
  options.keep_every = 4;
  Checkpointer checkpointer(options, *comm);
  for (int64_t step = 1; step <= 9; ++step) checkpointer.save(request(step, replicated_state(1)));
  checkpointer.wait();
  std::vector<int64_t> steps;
  for (const auto& e : list_checkpoints(dir.path())) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{4, 8, 9}));
}

TEST(Ckpt, PruneNeverRemovesTheNewestNorOneBeingWritten) {
  TempDir dir;
  for (int step : {1, 2, 3, 4, 5})
    std::filesystem::create_directories(dir / ("step-" + std::to_string(step)));
  std::filesystem::create_directories(dir / "step-6.tmp");
  auto removed = prune_checkpoints(dir.path(), 2, 0);
  EXPECT_EQ(removed.size(), 3u);
  std::vector<std::string> left;
  for (const auto& e : list_checkpoints(dir.path())) left.push_back(e.path.filename().string());
  EXPECT_EQ(left, (std::vector<std::string>{"step-4", "step-5", "step-6.tmp"}));
  EXPECT_THROW(
      Checkpointer(CheckpointOptions{dir.path(), 1, 0, true}, *single_process_communicator()),
      UserError);
}

TEST(Ckpt, AStaleTmpDirectoryIsNeverLoadedAndIsCleanedUp) {
  TempDir dir;
  auto comm = single_process_communicator();
  {
    Checkpointer checkpointer(options_for(dir.path(), false), *comm);
    checkpointer.save(request(1, replicated_state(1)));
  }
  std::filesystem::copy(dir / "step-1", dir / "step-2.tmp");  // as if killed before the rename
  auto targets = empty_like(replicated_state(1));
  auto loaded = load_latest_checkpoint(dir.path(), targets, *comm);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->index.step, 1);
  Checkpointer next(options_for(dir.path(), false), *comm);
  EXPECT_FALSE(std::filesystem::exists(dir / "step-2.tmp"));
}

TEST(Ckpt, TwoRanksWriteInParallelAndSpreadReplicatedTensors) {
  TempDir dir;
  const auto state = replicated_state(3);
  run_ranks(2, [&](Communicator& comm) {
    Checkpointer checkpointer(options_for(dir.path(), /*async=*/true), comm);
    auto mine = replicated_state(3);
    mine.push_back(shard_of("rows", iota(10, 4), 0, comm.rank(), 2));
    auto handle = checkpointer.save(request(3, mine));
    checkpointer.wait();
    if (!handle->committed()) throw std::runtime_error(handle->error());
  });
  CheckpointIndex index = read_checkpoint_index(dir / "step-3");
  EXPECT_EQ(index.world_size, 2);
  ASSERT_EQ(index.files.size(), 2u);
  std::map<std::string, uint64_t> bytes_per_file;
  uint64_t largest = 0;
  for (const auto& t : state) {
    const TensorInfo* info = index.find(t.name);
    ASSERT_NE(info, nullptr) << t.name;
    ASSERT_EQ(info->chunks.size(), 1u) << "a replicated tensor is written once";
    bytes_per_file[info->chunks[0].file] += t.tensor.nbytes();
    largest = std::max<uint64_t>(largest, t.tensor.nbytes());
  }
  ASSERT_EQ(bytes_per_file.size(), 2u) << "both ranks write replicated tensors";
  const uint64_t a = bytes_per_file.begin()->second, b = bytes_per_file.rbegin()->second;
  EXPECT_LE(std::max(a, b) - std::min(a, b), largest) << "bytes balanced across ranks";
  EXPECT_EQ(index.find("rows")->chunks.size(), 2u);
  EXPECT_TRUE(verify_checkpoint(dir / "step-3").ok());
}

TEST(Ckpt, ReshardsTwoRanksToOne) {
  TempDir dir;
  const auto whole = iota(10, 6);
  run_ranks(2, [&](Communicator& comm) {
    Checkpointer checkpointer(options_for(dir.path(), /*async=*/false), comm);
    auto mine = replicated_state(4);
    mine.push_back(shard_of("rows", whole, 0, comm.rank(), 2));
    mine.push_back(shard_of("cols", whole, 1, comm.rank(), 2));
    checkpointer.save(request(4, mine));
  });
  auto comm = single_process_communicator();
  auto targets = empty_like(replicated_state(4));
  targets.push_back({"rows", torch::zeros({10, 6})});  // the whole tensor at world size 1
  targets.push_back({"cols", torch::zeros({10, 6})});
  load_checkpoint(dir / "step-4", targets, *comm);
  auto expected = replicated_state(4);
  for (size_t k = 0; k < expected.size(); ++k)
    EXPECT_TRUE(torch::equal(targets[k].tensor, expected[k].tensor));
  EXPECT_TRUE(torch::equal(targets[expected.size()].tensor, whole));
  EXPECT_TRUE(torch::equal(targets[expected.size() + 1].tensor, whole));
}

TEST(Ckpt, ReshardsOneRankToTwo) {
  TempDir dir;
  const auto whole = iota(9, 5);
  {
    auto comm = single_process_communicator();
    Checkpointer checkpointer(options_for(dir.path(), /*async=*/false), *comm);
    auto state = replicated_state(5);
    state.push_back(shard_of("rows", whole, 0, 0, 1));
    checkpointer.save(request(5, state));
  }
  run_ranks(2, [&](Communicator& comm) {
    auto targets = empty_like(replicated_state(5));
    StateTensor piece = shard_of("rows", whole, 0, comm.rank(), 2);
    const auto expected_piece = piece.tensor.clone();
    piece.tensor.zero_();
    targets.push_back(piece);
    load_checkpoint(dir / "step-5", targets, comm);
    auto expected = replicated_state(5);
    for (size_t k = 0; k < expected.size(); ++k) {
      if (!torch::equal(targets[k].tensor, expected[k].tensor))
        throw std::runtime_error("replicated differs");
    }
    if (!torch::equal(targets.back().tensor, expected_piece))
      throw std::runtime_error("piece differs");
  });
}

// A rank holding several boxes of one tensor (a fused tensor-parallel slice: rank r's rows of
// each of 3 blocks) saves them as parts ("name#k" in its file), loads them back in place, and
// one process reads the whole tensor; the same part listed twice is refused.
TEST(Ckpt, PartsOfOnePieceRoundTripAndReshard) {
  TempDir dir;
  const auto whole = iota(12, 3);  // 3 blocks of 4 rows; rank r holds rows [2r, 2r + 2) of each
  auto parts_of = [&](int rank, bool zero) {
    std::vector<StateTensor> out;
    for (int block = 0; block < 3; ++block) {
      StateTensor t("fused", whole.narrow(0, block * 4 + 2 * rank, 2).clone(), {12, 3},
                    {block * 4 + 2 * rank, 0});
      if (zero) t.tensor.zero_();
      t.part = block;
      out.push_back(std::move(t));
    }
    return out;
  };
  run_ranks(2, [&](Communicator& comm) {
    Checkpointer checkpointer(options_for(dir.path(), /*async=*/false), comm);
    auto handle = checkpointer.save(request(2, parts_of(comm.rank(), false)));
    checkpointer.wait();
    if (!handle->committed()) throw std::runtime_error(handle->error());
  });
  EXPECT_TRUE(verify_checkpoint(dir / "step-2").ok());
  const CheckpointIndex index = read_checkpoint_index(dir / "step-2");
  ASSERT_NE(index.find("fused"), nullptr);
  EXPECT_EQ(index.find("fused")->chunks.size(), 6u);
  run_ranks(2, [&](Communicator& comm) {
    auto targets = parts_of(comm.rank(), true);
    load_checkpoint(dir / "step-2", targets, comm);
    const auto expected = parts_of(comm.rank(), false);
    for (size_t k = 0; k < targets.size(); ++k) {
      if (!torch::equal(targets[k].tensor, expected[k].tensor))
        throw std::runtime_error("part " + std::to_string(k) + " differs");
    }
  });
  auto comm = single_process_communicator();
  std::vector<StateTensor> one = {{"fused", torch::zeros({12, 3})}};
  load_checkpoint(dir / "step-2", one, *comm);
  EXPECT_TRUE(torch::equal(one[0].tensor, whole));
  auto twice = parts_of(0, true);
  twice[1].part = 0;
  EXPECT_THROW(load_checkpoint(dir / "step-2", twice, *comm), UserError);
  Checkpointer checkpointer(options_for(dir / "again", /*async=*/false), *comm);
  EXPECT_THROW(checkpointer.save(request(3, twice)), UserError);
}

TEST(Ckpt, ShardedLoadReadsOnlyTheOverlappingBytes) {
  TempDir dir;
  const auto whole = iota(1024, 256);  // 1 MiB
  run_ranks(2, [&](Communicator& comm) {
    Checkpointer checkpointer(options_for(dir.path(), /*async=*/true), comm);
    checkpointer.save(request(6, {shard_of("w", whole, 0, comm.rank(), 2)}));
    checkpointer.wait();
  });
  std::mutex mutex;
  std::vector<uint64_t> bytes_read(4);
  run_ranks(4, [&](Communicator& comm) {
    for (int64_t dim : {0, 1}) {
      StateTensor piece = shard_of("w", whole, dim, comm.rank(), 4);
      const auto expected = piece.tensor.clone();
      piece.tensor.zero_();
      std::vector<StateTensor> targets = {piece};
      LoadResult result = load_checkpoint(dir / "step-6", targets, comm);
      if (!torch::equal(targets[0].tensor, expected))
        throw std::runtime_error("wrong values for dim " + std::to_string(dim));
      if (result.bytes_read != expected.nbytes())
        throw std::runtime_error("read more than the piece");
      std::lock_guard lock(mutex);
      bytes_read[static_cast<size_t>(comm.rank())] += result.bytes_read;
    }
  });
  for (uint64_t b : bytes_read) EXPECT_EQ(b, 2 * whole.nbytes() / 4);
}

TEST(Ckpt, RanksThatDisagreeFailTogether) {
  TempDir dir;
  // A committed checkpoint first: a refused save must add nothing and leave it as it was.
  run_ranks(2, [&](Communicator& comm) {
    Checkpointer checkpointer(options_for(dir.path(), true), comm);
    checkpointer.save(request(1, replicated_state(1)));
    checkpointer.wait();
  });
  const std::string index_before = slurp(dir / "step-1" / "index.json");
  EXPECT_THAT(
      [&] {
        run_ranks(2, [&](Communicator& comm) {
          Checkpointer checkpointer(options_for(dir.path(), true), comm);
          checkpointer.save(request(comm.rank() == 0 ? 2 : 3, replicated_state(1)));
        });
      },
      ::testing::ThrowsMessage<UserError>(HasSubstr("every rank must save the same step")));
  EXPECT_THAT(
      [&] {
        run_ranks(2, [&](Communicator& comm) {
          Checkpointer checkpointer(options_for(dir.path(), true), comm);
          auto state = replicated_state(1);
          if (comm.rank() == 1) state.pop_back();
          checkpointer.save(request(2, state));
        });
      },
      ::testing::ThrowsMessage<UserError>(HasSubstr("other replicated tensors")));
  EXPECT_THAT(
      [&] {
        run_ranks(2, [&](Communicator& comm) {
          Checkpointer checkpointer(options_for(dir.path(), true), comm);
          checkpointer.save(
              request(2, {shard_of("w", iota(8, 2), 0, 0, 2)}));  // both ranks claim rows 0-3
        });
      },
      ::testing::ThrowsMessage<UserError>(HasSubstr("overlap")));
  const std::vector<CheckpointEntry> entries = list_checkpoints(dir.path());
  ASSERT_EQ(entries.size(), 1u) << "a refused save left a directory behind";
  EXPECT_EQ(entries[0].step, 1);
  EXPECT_TRUE(entries[0].committed);
  EXPECT_EQ(slurp(dir / "step-1" / "index.json"), index_before);
  EXPECT_TRUE(verify_checkpoint(dir / "step-1").ok());
  EXPECT_EQ(slurp(dir / "latest"), "step-1\n");
}

// Saving a step that exists replaces it whole; and the on-disk states a crash can leave while a
// step is replaced (without RENAME_EXCHANGE: step-N moved to step-N.replaced, then step-N.tmp
// renamed to step-N) never lose the committed one: the next Checkpointer restores or keeps it.
TEST(Ckpt, AStepSavedAgainIsReplacedWholeAndACrashMidReplaceLosesNothing) {
  TempDir dir;
  auto comm = single_process_communicator();
  const auto step2 = dir / "step-2";
  auto load_step2 = [&] {
    auto loaded = empty_like(replicated_state(0));
    load_checkpoint(step2, loaded, *comm);
    return loaded;
  };
  {
    Checkpointer checkpointer(options_for(dir.path(), false), *comm);
    ASSERT_TRUE(checkpointer.save(request(1, replicated_state(1)))->committed());
    ASSERT_TRUE(checkpointer.save(request(2, replicated_state(2)))->committed());
  }
  {
    Checkpointer checkpointer(options_for(dir.path(), false), *comm);
    auto handle = checkpointer.save(request(2, replicated_state(3)));
    ASSERT_TRUE(handle->committed()) << handle->error();
  }
  expect_same(load_step2(), replicated_state(3));
  EXPECT_FALSE(std::filesystem::exists(dir / "step-2.tmp"));
  EXPECT_FALSE(std::filesystem::exists(dir / "step-2.replaced"));

  // Killed between the two renames: the committed step-2 is only step-2.replaced, and the new
  // save (index written) is still step-2.tmp.
  std::filesystem::rename(step2, dir / "step-2.replaced");
  std::filesystem::copy(dir / "step-1", dir / "step-2.tmp");
  {
    Checkpointer checkpointer(options_for(dir.path(), false), *comm);
  }
  ASSERT_TRUE(std::filesystem::exists(step2 / "index.json")) << "the committed step-2 was lost";
  EXPECT_TRUE(verify_checkpoint(step2).ok());
  expect_same(load_step2(), replicated_state(3));
  EXPECT_FALSE(std::filesystem::exists(dir / "step-2.tmp"));
  EXPECT_FALSE(std::filesystem::exists(dir / "step-2.replaced"));

  // Killed after the second rename: step-2 is the new one, the .replaced copy is the old one.
  std::filesystem::copy(dir / "step-1", dir / "step-2.replaced");
  {
    Checkpointer checkpointer(options_for(dir.path(), false), *comm);
  }
  expect_same(load_step2(), replicated_state(3));
  EXPECT_FALSE(std::filesystem::exists(dir / "step-2.replaced"));
}

// Retention never removes the save it just committed, even when higher steps fill keep_last_k
// (a directory that also holds a later history: attach_checkpointing refuses to train into one,
// the Checkpointer itself must still never lose the new save).
TEST(Ckpt, RetentionNeverRemovesTheSaveItJustCommitted) {
  TempDir dir;
  auto comm = single_process_communicator();
  CheckpointOptions options = options_for(dir.path(), false);
  options.keep_last_k = 2;
  {
    Checkpointer checkpointer(options, *comm);
    for (int64_t step : {10, 11}) checkpointer.save(request(step, replicated_state(1)));
  }
  Checkpointer checkpointer(options, *comm);
  auto handle = checkpointer.save(request(3, replicated_state(2)));
  ASSERT_TRUE(handle->committed()) << handle->error();
  EXPECT_TRUE(verify_checkpoint(dir / "step-3").ok()) << "the new save was pruned";
  EXPECT_TRUE(std::filesystem::exists(dir / "step-10"));
  EXPECT_TRUE(std::filesystem::exists(dir / "step-11"));
}

TEST(Ckpt, LoadNamesMissingOrMismatchedTensorsAndLeavesTargetsUntouched) {
  TempDir dir;
  auto comm = single_process_communicator();
  {
    Checkpointer checkpointer(options_for(dir.path(), false), *comm);
    checkpointer.save(request(1, replicated_state(1)));
  }
  std::vector<StateTensor> missing = {{"model/nope", torch::zeros({2})}};
  EXPECT_THAT([&] { load_checkpoint(dir / "step-1", missing, *comm); },
              ::testing::ThrowsMessage<UserError>(HasSubstr("has no tensor 'model/nope'")));
  std::vector<StateTensor> wrong_shape = {{"model/a.weight", torch::zeros({32, 64})}};
  EXPECT_THAT(
      [&] { load_checkpoint(dir / "step-1", wrong_shape, *comm); },
      ::testing::ThrowsMessage<UserError>(HasSubstr("has shape [64, 32] in the checkpoint")));

  flip_byte(dir / "step-1" / "rank-0.safetensors", -3);
  auto targets = empty_like(replicated_state(1));
  for (auto& t : targets) t.tensor.fill_(0);
  EXPECT_THAT([&] { load_checkpoint(dir / "step-1", targets, *comm); },
              ::testing::ThrowsMessage<UserError>(HasSubstr("xxh3 does not match")));
  for (const auto& t : targets) EXPECT_EQ(t.tensor.count_nonzero().item<int64_t>(), 0) << t.name;
}

TEST(Ckpt, WriteErrorFailsTheHandleAndKeepsThePreviousCheckpoint) {
  SmallDisk disk(3 << 20);
  TempDir fallback;
  const bool tmpfs = disk.mounted();
  if (!tmpfs)
    std::cout << "[ note ] tmpfs mount refused (" << disk.why() << "); using RLIMIT_FSIZE\n";
  const std::filesystem::path dir = tmpfs ? disk.path() : fallback.path();
  auto comm = single_process_communicator();
  Checkpointer checkpointer(options_for(dir, /*async=*/true), *comm);
  std::vector<StateTensor> small = {{"w", torch::randn({64 << 10})}};  // 256 KiB
  std::vector<StateTensor> large = {{"w", torch::randn({1 << 20})}};   // 4 MiB: does not fit
  auto first = checkpointer.save(request(1, small));
  checkpointer.wait();
  ASSERT_TRUE(first->committed()) << first->error();
  struct rlimit saved{};
  if (!tmpfs) {
    ::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &saved);
    struct rlimit limit = saved;
    limit.rlim_cur = 1 << 20;
    ::setrlimit(RLIMIT_FSIZE, &limit);
  }
  auto second = checkpointer.save(request(2, large));
  checkpointer.wait();
  if (!tmpfs) ::setrlimit(RLIMIT_FSIZE, &saved);
  EXPECT_TRUE(second->finished());
  EXPECT_FALSE(second->committed());
  EXPECT_THAT(second->error(), HasSubstr(tmpfs ? "No space left on device" : "File too large"));
  EXPECT_THROW(second->rethrow_if_failed(), UserError);
  EXPECT_FALSE(std::filesystem::exists(dir / "step-2.tmp"))
      << "a failed save cleans up after itself";
  EXPECT_FALSE(std::filesystem::exists(dir / "step-2"));
  EXPECT_TRUE(verify_checkpoint(dir / "step-1").ok());
  EXPECT_EQ(slurp(dir / "latest"), "step-1\n");
}

}  // namespace
}  // namespace kiln::testing
