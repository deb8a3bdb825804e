#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>

#include "core/files.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/models.h"
#include "kiln/peer.h"
#include "kiln/safetensors.h"
#include "kiln/train.h"

namespace kiln {
namespace {

// Every parameter's gradient of the first step, before clipping and the optimizer: the sum over
// the micro-batches of d(loss / accum)/dp, from the initial weights. Computed with
// torch::autograd::grad on a forward of its own, so no parameter's .grad is touched and the
// trainer's first step runs exactly as without it.
void write_first_step_gradients(Model& model, const std::vector<Batch>& micro_batches,
                                const std::filesystem::path& out_dir) {
  model.train();
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  for (const auto& item : model.named_parameters()) {
    names.push_back(item.key());
    params.push_back(item.value());
  }
  const auto device = params.front().device();
  std::vector<torch::Tensor> sums(params.size());
  const auto accum = static_cast<double>(micro_batches.size());
  for (const Batch& batch : micro_batches) {
    auto logits = model.forward(batch.inputs.to(device));
    auto loss = model.loss(logits, batch.targets.to(device)) / accum;
    auto grads = torch::autograd::grad({loss}, params, /*grad_outputs=*/{}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      sums[i] = sums[i].defined() ? sums[i] + grads[i] : grads[i];
    }
  }
  NamedTensors out;
  for (size_t i = 0; i < params.size(); ++i) {
    out.emplace_back(names[i],
                     sums[i].defined() ? sums[i].cpu() : torch::zeros_like(params[i]).cpu());
  }
  write_safetensors(out_dir / "grads.safetensors", out, {{"format", "pt"}, {"source", "kiln"}});
}

}  // namespace

nlohmann::json export_for_peer(const Config& config, int64_t steps,
                               const std::filesystem::path& out_dir, double initial_loss_scale) {
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) throw UserError("cannot create " + out_dir.string() + ": " + ec.message());
  apply_runtime_settings(config);
  Datasets data = make_datasets(config);
  auto model = make_model(config);
  NamedTensors init;
  for (const auto& item : model->named_parameters())
    init.emplace_back(item.key(), item.value().clone());
  write_safetensors(out_dir / "init.safetensors", init, {{"format", "pt"}, {"source", "kiln"}});
  write_file_atomic(out_dir / "config.toml", config.to_toml(false));

  Trainer trainer(TrainerSetup::from_config(config), model, std::move(data),
                  TrainerOptions{resolve_device(config), 0, 1});
  // The configured step's recomputation too (as kiln train composes it), so the peer checks it.
  if (trainer.train_options().activation_checkpointing ==
      TrainOptions::ActivationCheckpointing::kBlock) {
    install_activation_checkpointing(trainer);
  }
  if (initial_loss_scale > 0) {
    TrainState state = trainer.state();
    if (!state.grad_scaler.is_object()) {
      throw UserError(fmt::format(
          "--initial-loss-scale {} needs a loss scaler: set train.precision = \"fp16-mixed\"",
          initial_loss_scale));
    }
    state.grad_scaler["scale"] = initial_loss_scale;
    trainer.load_state(state);
  }
  const int64_t accum = TrainOptions::from_config(config).grad_accum_steps;
  std::vector<std::vector<Batch>> batches(static_cast<size_t>(steps));
  NamedTensors batch_tensors;
  for (int64_t k = 0; k < steps; ++k) {
    for (int64_t m = 0; m < accum; ++m) {
      Batch batch = trainer.next_batch();
      batch_tensors.emplace_back(fmt::format("step{}.micro{}.inputs", k, m), batch.inputs);
      batch_tensors.emplace_back(fmt::format("step{}.micro{}.targets", k, m), batch.targets);
      batches[static_cast<size_t>(k)].push_back(std::move(batch));
    }
  }
  write_safetensors(out_dir / "batches.safetensors", batch_tensors);
  if (steps > 0) write_first_step_gradients(*model, batches.front(), out_dir);

  nlohmann::json result = {{"steps", steps},
                           {"loss", nlohmann::json::array()},
                           {"grad_norm", nlohmann::json::array()},
                           {"lr", nlohmann::json::array()},
                           {"step_seconds", nlohmann::json::array()},
                           {"skipped", nlohmann::json::array()},
                           {"loss_scale", nlohmann::json::array()}};
  for (int64_t k = 0; k < steps; ++k) {
    StepStats s = trainer.train_step_on(batches[static_cast<size_t>(k)]);
    result["loss"].push_back(s.loss);
    result["grad_norm"].push_back(s.grad_norm);
    result["lr"].push_back(s.lr);
    result["step_seconds"].push_back(s.step_seconds);
    // Outside the timed step: reading the scale back syncs with the device.
    const nlohmann::json scaler = trainer.state().grad_scaler;
    result["skipped"].push_back(s.skipped);
    result["loss_scale"].push_back(scaler.is_object() ? scaler["scale"] : nlohmann::json(nullptr));
  }
  write_file_atomic(out_dir / "kiln.json",
                    result.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  log::info(fmt::format("exported {} steps to {}", steps, out_dir.string()));
  return result;
}

}  // namespace kiln
