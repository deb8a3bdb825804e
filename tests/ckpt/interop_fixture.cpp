// Writes the fixture the Python interop test reads: a tiny GPT trained 3 steps and saved by two
// thread-backed ranks (replicated tensors spread over rank-0/rank-1 files, plus a sharded tensor
// and a bf16 one), and the logits kiln computes for fixed tokens.
//   kiln_ckpt_fixture <out dir>  ->  <out>/ckpt/step-3/, <out>/expected.safetensors,
//   <out>/model.json
#include <fstream>
#include <iostream>

#include "ckpt/thread_comm.h"
#include "kiln/checkpoint.h"
#include "kiln/safetensors.h"
#include "support/helpers.h"

int main(int argc, char** argv) {
  using namespace kiln;
  if (argc != 2) {
    std::cerr << "usage: kiln_ckpt_fixture <out dir>\n";
    return 2;
  }
  try {
    const std::filesystem::path out = argv[1];
    std::filesystem::remove_all(out);
    std::filesystem::create_directories(out);
    Config config =
        testing::gpt_config(out / "runs", {"data.num_workers=0", "optim.weight_decay=0.1"});
    apply_runtime_settings(config);
    Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
    for (int k = 0; k < 3; ++k) trainer.train_step();

    const auto rows = torch::arange(7 * 5, torch::kFloat).view({7, 5});
    const auto bf16 = torch::linspace(-2, 2, 9).to(torch::kBFloat16);
    testing::run_ranks(2, [&](Communicator& comm) {
      SaveRequest request = capture_training_state(trainer, comm, {});
      const int64_t begin = comm.rank() == 0 ? 0 : 4, size = comm.rank() == 0 ? 4 : 3;
      request.tensors.emplace_back("extra/sharded", rows.narrow(0, begin, size).clone(),
                                   std::vector<int64_t>{7, 5}, std::vector<int64_t>{begin, 0});
      request.tensors.emplace_back("extra/bf16", bf16);
      Checkpointer checkpointer(CheckpointOptions{out / "ckpt", 3, 0, true}, comm);
      auto handle = checkpointer.save(request);
      checkpointer.wait();
      handle->rethrow_if_failed();
    });

    torch::NoGradGuard no_grad;
    trainer.model().eval();
    auto gen = at::detail::createCPUGenerator(7);
    const auto tokens = torch::randint(0, 256, {2, 16}, gen, torch::kLong);
    const auto logits = trainer.model().forward(tokens);
    write_safetensors(out / "expected.safetensors", {{"input_ids", tokens}, {"logits", logits}});
    const GptConfig gpt = resolve_gpt_config(config);
    std::ofstream(out / "model.json") << nlohmann::json{
        {"n_layer", gpt.n_layer},
        {"n_head", gpt.n_head},
        {"n_embd", gpt.n_embd},
        {"block_size", gpt.block_size},
        {"vocab_size", gpt.vocab_size}}.dump();
    std::cout << "fixture written to " << out.string() << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "kiln_ckpt_fixture: " << e.what() << "\n";
    return 1;
  }
}
