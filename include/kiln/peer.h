// Export for a peer implementation: what an independent trainer (bench/peer/peer.py, Python
// PyTorch) needs to replay kiln's first steps exactly and compare losses step by step.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace kiln {

class Config;

/// Trains `steps` optimizer steps from the config and writes into `out_dir`:
///   config.toml          the resolved config
///   init.safetensors     the initial weights (kiln/HF names)
///   batches.safetensors  "step<k>.micro<m>.inputs" / ".targets" for every micro-batch used
///   grads.safetensors    every parameter's gradient of the first step (kiln names), before
///                        clipping and the optimizer: the sum over step 0's micro-batches of the
///                        gradients of loss / grad_accum_steps, from the initial weights (written
///                        when steps > 0)
///   kiln.json            per-step loss, grad_norm, lr, step_seconds (batches preloaded in memory,
///                        so step time excludes data loading, as on the peer's side), skipped
///                        (the step changed no parameter: a loss-scaler overflow or a non-finite
///                        skip) and loss_scale (fp16-mixed: the scaler's scale after the step;
///                        null otherwise)
/// `initial_loss_scale` > 0 (fp16-mixed only) starts the loss scaler at that scale instead of
/// 65536 (torch.amp.GradScaler's init_scale), e.g. one so large that the first steps overflow.
/// Returns kiln.json's content. Throws UserError.
nlohmann::json export_for_peer(const Config& config, int64_t steps,
                               const std::filesystem::path& out_dir, double initial_loss_scale = 0);

}  // namespace kiln
