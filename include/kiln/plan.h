// Plan: the analytic model of a training job — parameter count, FLOPs, memory, the DDP/FSDP
// strategy rule, the hardware catalog, and the time and budget of the whole process — computed
// from the config alone, never by allocating the model (so a 6.7B or 70B config plans in seconds
// on a laptop). Every formula and its source is in docs/plan.md.
//
// Pure functions of their inputs; thread-safe. Bytes are doubles (a 70B model's state exceeds
// what a reader can check in int64 at a glance, and every figure here is an estimate).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/models.h"
#include "kiln/results.h"

namespace kiln {

class Config;

// ---- strategy rule (shared with dist.strategy = "auto") ----------------------------------------

/// What choose_strategy() needs, all per device of one job.
struct StrategyInput {
  /// Model state under DDP (every device holds all of it): parameters x bytes per parameter for
  /// the optimizer and precision (fp32 AdamW: 4 parameter + 4 gradient + 8 moments = 16 B).
  double ddp_model_state_bytes = 0;
  /// Parameter bytes of the largest FSDP unit, gathered whole on every device while it runs (one
  /// transformer block, or the embeddings + final-norm group, whichever is larger).
  double largest_unit_parameter_bytes = 0;
  /// Activation bytes per device for one micro-batch (measured by a pilot, or estimated): what
  /// the step holds at its peak beyond the state and the weights' compute copies (the saved
  /// activations, the logits and their gradients, backward's working buffers).
  double activation_bytes = 0;
  /// Mixed precision under DDP: autocast's compute-dtype copies of the weights, the whole
  /// model's, live at the peak (0 in fp32; FSDP gathers each unit in the compute dtype itself,
  /// within largest_unit_parameter_bytes: no copies).
  double weight_copy_bytes = 0;
  /// The job already checkpoints activations (the advice when nothing fits leaves it out).
  bool activation_checkpointing = false;
  /// Memory of one device (bytes).
  double device_memory_bytes = 0;
  /// Fraction of device memory kept free (allocator fragmentation, workspaces, comm buffers);
  /// usable memory is device_memory_bytes x (1 - headroom_fraction). In [0, 1).
  double headroom_fraction = 0.1;
  /// Devices in the job (world size); FSDP degrees considered are the divisors of it.
  int64_t gpu_count = 1;
  /// Devices on one node, the fast link (NVLink); 0: all gpu_count on one node.
  int64_t gpus_per_node = 0;
  /// Tensor parallelism (TP): the TP degrees (> 1) the model's plan can split it over (dividing
  /// its key/value heads and MLP width; empty: the model has no plan, or TP is not allowed), and
  /// the fraction of the model state and of the largest unit in the tensors the plan slices (the
  /// rest, embeddings and norms, stays whole on every TP rank).
  std::vector<int64_t> tensor_parallel_degrees;
  double tensor_parallel_fraction = 0;
  /// The largest unit's parameter bytes at each of tensor_parallel_degrees (a block's slice, or
  /// the whole embeddings group, whichever is larger); a degree missing: largest_unit x the
  /// fraction kept.
  std::map<int64_t, double> tensor_parallel_unit_bytes;
  /// Communication figures, for choosing between layouts that fit: the bytes of all parameters
  /// as FSDP gathers them (twice per micro-batch) and reduce-scatters their gradients (once),
  /// the bytes TP all-reduces per micro-batch (4 per layer: 2 forward, 2 backward, of the
  /// [b, s, C] activations), micro-batches per step, and each link's bandwidth per device
  /// (bytes/s; 0 = unknown).
  double parameter_bytes = 0;
  double tensor_parallel_bytes = 0;
  int64_t grad_accum_steps = 1;
  double intra_node_bytes_per_second = 0, inter_node_bytes_per_second = 0;
};

/// The decision and the numbers behind it.
struct StrategyDecision {
  /// "ddp" when model state + activations fit on every device; else "fsdp" at the smallest degree
  /// that fits; else "does-not-fit".
  std::string strategy;
  /// The FSDP degree (dp_shard: a divisor of gpu_count / tp_degree, >= 2) of the layout chosen;
  /// 0 for DDP or when none fits.
  int64_t fsdp_degree = 0;
  /// The tensor-parallel degree of the layout chosen (1: none). The layout is dp_replicate x
  /// dp_shard x tp = (gpu_count / (fsdp_degree x tp_degree)) x fsdp_degree x tp_degree.
  int64_t tp_degree = 1;
  /// The chosen layout's communication per step, seconds, on its links, not overlapped: DDP's
  /// ring all-reduce of the gradients; FSDP's two gathers and one reduce-scatter per micro-batch
  /// on the shard group's link and the replicas' all-reduce of the shards; TP's all-reduces
  /// (0 when a link's bandwidth is unknown, or nothing fits).
  double communication_seconds = 0;
  /// usable = device_memory_bytes x (1 - headroom_fraction).
  double usable_bytes = 0;
  /// DDP per device: ddp_model_state_bytes + weight_copy_bytes + activation_bytes.
  double ddp_bytes_per_device = 0;
  /// FSDP per device at fsdp_degree (at gpu_count when no degree fits; equal to the DDP figure
  /// when gpu_count is 1): state / degree + largest_unit_parameter_bytes + activation_bytes.
  double fsdp_bytes_per_device = 0;
  /// One line with the numbers, e.g. "ddp needs 107.3 GB/device > 72.0 GB usable; fsdp over 8
  /// needs 14.2 GB/device". For "does-not-fit" it names the ways out: activation checkpointing,
  /// a smaller micro-batch, more GPUs.
  std::string reason;
};

/// The strategy rule (docs/plan.md, "Strategy"): DDP when it fits; else FSDP at the smallest
/// fitting degree inside a node (hybrid sharding over the nodes); else, of FSDP across nodes at
/// its smallest fitting degree and each TP degree inside a node with FSDP at its smallest fitting
/// degree over the rest, the one that communicates least per step (without bandwidths: FSDP);
/// else does-not-fit. Never throws for non-negative input; a gpu_count < 1
/// or a headroom outside [0, 1) is a programming error (std::invalid_argument).
StrategyDecision choose_strategy(const StrategyInput& input);

/// JSON of a decision (plan.json, reports).
nlohmann::json to_json(const StrategyDecision& decision);

// ---- the model, analytically ------------------------------------------------------------------

/// The shape of the configured model, read from the config without building it.
struct ModelShape {
  /// model.name, for messages and plan.json: the plan reads a model only through its
  /// ModelSpec::math (kiln/models.h), kiln's own models as any other.
  std::string architecture;
  bool tokens = true;  // a token model (its job has data.seq_len tokens per sample)
  /// The walk the memory model takes through the step (ModelMath::step_layout).
  ModelMath::StepLayout layout = ModelMath::StepLayout::kGeneric;
  int64_t n_layer = 0, n_head = 0, n_embd = 0, block_size = 0, vocab_size = 0;  // token models
  int64_t n_kv_head = 0, intermediate_size = 0;  // key/value heads, the MLP's inner width
  bool tie_embeddings = false;                   // the head is the token embedding's weight
  int64_t input_dim = 0, hidden_dim = 0, num_classes = 0;  // feature models (the mlp)
  /// The ModelMath counts the parameter, unit and FLOP counts below return.
  int64_t math_parameters = 0, math_largest_unit_parameters = 0, math_flop_parameters = 0,
          math_attention_layers = 0, math_attention_width = 0;
  /// Its ModelMath activation figures (elements per sample; 0: unknown) and unit count.
  double math_activation_elements = 0, math_unit_activation_elements = 0,
         math_unit_input_elements = 0;
  int64_t math_units = 0;
  /// Tensor parallelism: the parameters the model's plan slices (ModelMath), and the degrees
  /// 2..n_kv_head its plan accepts for this config (ModelSpec::tensor_parallel_problem; empty
  /// without a plan).
  int64_t math_tensor_parallel_parameters = 0, math_tensor_parallel_block_parameters = 0;
  std::vector<int64_t> tensor_parallel_degrees;
};

/// The config's model shape, from the model's ModelSpec::math. Throws UserError for a shape the
/// model cannot be built with (as resolve_gpt_config / resolve_llama_config), or a model that
/// registers no math.
ModelShape model_shape(const Config& config);

/// Scalar parameters of the model kiln builds for `shape` (ModelMath::parameters; equal to
/// parameter_count(*make_model(config)), tests hold them equal). gpt: V*C + block*C +
/// L*(12C^2 + 13C) + 2C (tied head, biases, LayerNorm weight and bias); llama: V*C (x2 untied) +
/// L*(2C*H*D + 2C*K*D + 3C*I + 2C) + C; the mlp: d*h + h + h*k + k.
int64_t analytic_parameter_count(const ModelShape& shape);

/// Parameters of the largest FSDP unit (ModelMath::largest_unit_parameters): gpt one transformer
/// block (12C^2 + 13C) or the embeddings + final-norm group (V*C + block*C + 2C), whichever is
/// larger; the mlp its larger layer.
int64_t largest_unit_parameter_count(const ModelShape& shape);

/// Training FLOPs (forward + backward) per token at `seq_len`, ModelMath::train_flops_per_token:
/// 6N + 12*L*w*T with N the parameters a token multiplies by (gpt: without the position
/// embedding, PaLM appendix B; llama: without an untied embedding; the mlp: all, per sample) and
/// w the attention width. With full activation checkpointing one more forward: 8N + 16LwT.
double train_flops_per_token(const ModelShape& shape, int64_t seq_len,
                             bool activation_checkpointing = false);

// ---- memory model
// --------------------------------------------------------------------------------

/// The job's shape per device, as the config states it (train.batch_size is the micro-batch).
struct JobShape {
  int64_t micro_batch = 1;
  int64_t seq_len = 1;  // tokens per sample (1 for the mlp)
  int64_t grad_accum_steps = 1;
  int64_t world_size = 1;
  std::string optimizer = "adamw";  // "adamw" | "sgd"
  bool momentum = false;            // sgd: a momentum buffer
  /// "fp32" | "bf16" | "fp16": the compute precision (train.precision when declared, else fp32).
  /// The mixed precisions keep fp32 parameters, gradients and optimizer state.
  std::string precision = "fp32";
  bool activation_checkpointing = false;
  /// How the world holds the model state, for the memory model's step peak: "none" (one process,
  /// or the plan's DDP/FSDP rule decides), "ddp" (every rank the whole state plus gradient
  /// buckets) or "fsdp" (sharded over world_size ranks, units gathered one at a time).
  std::string strategy = "none";
  bool fsdp_prefetch = true;               // dist.fsdp_prefetch
  bool fsdp_reshard_after_forward = true;  // dist.reshard_after_forward
  bool fsdp_accumulate_sharded = false;    // dist.fsdp_accumulate = "sharded"
  /// The mesh over world_size ranks (kiln/dist.h MeshShape; the caller that knows the layout
  /// sets it): tensor parallelism over `tp` ranks (each holds its slice of the model's split
  /// layers and their 1/tp of the heads' and MLP's activations), and FSDP's shards over
  /// world_size / (tp x dp_replicate) ranks (hybrid sharding's replicas hold the same shards).
  int64_t tp = 1;
  int64_t dp_replicate = 1;
};

/// The config's job shape: train.batch_size, data.seq_len (gpt), train.grad_accum_steps,
/// plan.gpus as the world size, optim.name / optim.momentum, train.precision when the schema
/// declares it (else "fp32"), activation checkpointing when train.activation_checkpointing is
/// "block" or plan.activation_checkpointing is set, and the dist.fsdp_* options (strategy stays
/// "none": the caller that knows the layout sets it).
JobShape job_shape(const Config& config);

/// Model-state bytes per parameter: 4 parameter + 4 gradient + optimizer (adamw 8, sgd with
/// momentum 4, plain sgd 0), the same for fp32 and the mixed precisions (fp32 master state).
double state_bytes_per_parameter(const JobShape& job);

/// The memory of one full optimizer step on one device (docs/plan.md, "Memory"), from a walk of
/// the step's allocations and frees in the order kiln's step makes them (forward unit by unit,
/// the loss, backward unit by unit with activation checkpointing's recomputation, FSDP's gathers
/// and reduce-scatter buffers, autocast's weight copies, accumulation). The parts are those live
/// at the step's peak; they sum to step_peak().
struct MemoryEstimate {
  /// Held across steps: parameters (FSDP: this rank's shards) and optimizer state.
  double parameters = 0, optimizer = 0;
  /// Gradients live at the peak (parameter gradients; FSDP: the gradient shards and the
  /// accumulated full gradients of earlier micro-batches).
  double gradients = 0;
  double activations = 0;     // saved for backward at the peak (unit inputs, blocks, the batch)
  double logits = 0;          // the [b, s, V] buffers live at the peak (logits, log-softmax, grads)
  double backward_extra = 0;  // backward's working buffers at the peak (activation gradients)
  double autocast_copies = 0;  // bf16/fp16 copies of the weights autocast made (mixed precision)
  /// FSDP: gathered units, all-gather buffers and reduce-scatter buffers; DDP: gradient buckets.
  double communication = 0;
  /// The gradients held after the step (until the next step's zero_grad): the parameter
  /// gradients, FSDP's gradient shards, DDP's buckets (the gradients are views of them).
  double gradients_after_step = 0;
  /// The step's peak: the sum of the parts above except gradients_after_step.
  double peak_bytes = 0;
  /// Where the peak falls, in words ("the loss's backward", "block 3's recomputation").
  std::string peak_at;
  /// Everything at once under DDP, unsharded (the strategy rule's figure): the full state
  /// (parameters, gradients, optimizer) plus one micro-batch's activations and logits.
  double everything_bytes = 0;
  double total() const { return everything_bytes; }
  double step_peak() const { return peak_bytes; }
  bool gradients_held = false;  // grad_accum_steps > 1
};
MemoryEstimate estimate_memory(const ModelShape& shape, const JobShape& job);
nlohmann::json to_json(const MemoryEstimate& estimate);

/// The strategy input for `device_memory_bytes` from the analytic model (the unsharded estimate:
/// activations and logits of one micro-batch; the config's plan.headroom and the job's world
/// size).
StrategyInput strategy_input(const ModelShape& shape, const JobShape& job,
                             double device_memory_bytes, double headroom_fraction);

// ---- hardware catalog
// ----------------------------------------------------------------------------

/// One accelerator of the catalog (configs/hardware.toml): figures as the vendor's datasheet
/// states them, each row with its source and date.
struct Device {
  std::string name;          // key, e.g. "h100-sxm"
  std::string display_name;  // "NVIDIA H100 SXM 80GB"
  double memory_bytes = 0;
  double memory_bandwidth_bytes_per_second = 0;
  std::string interconnect;                  // "NVLink 4", "Infinity Fabric"
  double interconnect_bytes_per_second = 0;  // per GPU, both directions summed
  int64_t gpus_per_node = 8;                 // GPUs on one interconnect domain
  double network_bytes_per_second = 0;       // per GPU, between nodes
  std::map<std::string, double> peak_flops;  // dense peak per precision: fp32 tf32 bf16 fp16
  std::string source, date;                  // where the figures come from, and when
  /// Host (CPU) memory of one node, bytes (0 = the row does not say): async checkpointing stages
  /// the state there. host_memory_source names where the figure comes from.
  double host_memory_bytes = 0;
  std::string host_memory_source;
  /// Upper-case words of a runtime device name that mean this row ("H100").
  std::vector<std::string> match;
  /// Dense peak FLOP/s for "fp32" | "tf32" | "bf16" | "fp16", or a train.precision value
  /// ("bf16-mixed" computes in bf16: its bf16 peak); 0 when the row has none.
  double peak_flops_for(std::string_view precision) const;
};

/// The built-in catalog (configs/hardware.toml of the source tree, or share/kiln/hardware.toml
/// of an install), with the rows of `extra_file` (plan.catalog; empty = none) added, replacing
/// built-in rows of the same name. Throws UserError naming the file and row for a malformed file.
std::vector<Device> load_catalog(const std::filesystem::path& extra_file = {});
/// The row called `name` (case-insensitive). Throws UserError "unknown hardware ... did you mean
/// ..." naming `key` (e.g. "plan.hardware").
const Device& find_device(const std::vector<Device>& catalog, std::string_view name,
                          std::string_view key);
/// The first catalog row whose `match` words occur in a runtime device name such as "NVIDIA H100
/// 80GB HBM3" (case-insensitive), or nullptr.
const Device* device_for_name(const std::vector<Device>& catalog, std::string_view device_name);

/// The precision the config trains in: train.precision when the schema declares it, else "fp32".
std::string training_precision(const Config& config);
/// The precision the matmuls run in: "bf16-mixed" -> "bf16", "fp16-mixed" -> "fp16", others
/// lower-cased as they are. The catalog's peak_tflops keys.
std::string compute_precision(std::string_view precision);

/// The dense peak FLOP/s for `precision` ("fp32" | "tf32" | "bf16" | "fp16") of the catalog row
/// (plan.catalog rows included) matching a runtime device name such as "NVIDIA H100 80GB HBM3";
/// 0 when no row matches ("cpu"). The baseline's MFU and the pilot use it.
double catalog_peak_flops(const Config& config, std::string_view device_name,
                          std::string_view precision);

/// The catalog row (plan.catalog rows included) matching a runtime device name, as
/// device_for_name; std::nullopt when none matches ("cpu", unless plan.catalog adds a row that
/// matches it). dist.strategy = "auto" reads its links through set_links().
std::optional<Device> catalog_device(const Config& config, std::string_view device_name);

/// A catalog row's node and links into the strategy rule's input, as `kiln plan` reads them for
/// that row: gpus_per_node, the intra-node bandwidth per device one way (the row's interconnect
/// figure sums both directions: half of it) and the network's between nodes.
void set_links(StrategyInput& input, const Device& device);

/// The runtime name of a device from a manifest's device records: "cpu" for cuda_index < 0, else
/// the record's "name" of CUDA device `cuda_index` ("cuda:<index>" when it has none).
std::string manifest_device_name(const nlohmann::json& manifest, int cuda_index);

// ---- time and budget ---------------------------------------------------------------------------

/// Young's optimal checkpoint interval tau = sqrt(2 delta M) (Young 1974; Daly 2006's first
/// order), with delta the time one save costs the job and M the job's mean time between failures.
double young_interval_seconds(double save_seconds, double job_mtbf_seconds);

/// The recovery-aware checkpoint period Tc = delta + sqrt(2 (M + R) delta + delta^2): the time
/// from one save's start to the next (the save included), with delta the save's stall, M the
/// job's MTBF and R the time a restart costs (requeue, process start, restore, first step): a
/// restart's cost lengthens the period beside Young's sqrt(2 delta M), which ignores it. 0 when
/// delta or M is not positive. Known answer: delta = 60 s, M = 3.1 h, R = 10 min: 1249.5 s.
double recovery_aware_interval_seconds(double save_seconds, double job_mtbf_seconds,
                                       double recovery_seconds);

/// Host memory and storage of one hardware row (docs/plan.md, "Host memory and storage").
struct HostNeeds {
  /// checkpoint.async: the state each saving rank of a node copies into host memory (DDP: rank
  /// 0's whole state; FSDP: the node's shards of one replica). 0 with synchronous saves.
  double staging_bytes_per_node = 0;
  /// The data loader's buffered batches: ranks on the node x data.prefetch batches of
  /// micro_batch x seq_len tokens, input and target as int64 (the mlp: float32 inputs).
  double loader_bytes_per_node = 0;
  double host_bytes_per_node = 0;  // the sum
  double host_memory_bytes = 0;    // the row's host_memory_gb (0 = the row does not say)
  bool host_fits = true;           // host_bytes_per_node <= host memory x (1 - plan.headroom)
  /// A 7-day reservation's disk: the checkpoints kept (checkpoint.keep_last_k, or the saves in
  /// 7 days when fewer) x checkpoint bytes + the data on disk (data.path's size).
  double storage_bytes = 0;
  double storage_limit_bytes = 0;  // plan.storage_tb (0 = not set: not checked)
  bool storage_fits = true;
  std::vector<std::string> warnings;  // one line per problem, each naming the key to change
};
HostNeeds host_needs(const Config& config, const Device& device, int64_t gpus,
                     const StrategyDecision& decision, double checkpoint_bytes,
                     double checkpoint_interval_seconds);
nlohmann::json to_json(const HostNeeds& needs);

/// The whole process's time on one hardware row (docs/plan.md, "Budget").
struct Budget {
  double step_seconds = 0;           // compute + exposed communication
  double compute_seconds = 0;        // per step
  double communication_seconds = 0;  // per step, not overlapped
  double train_seconds = 0;          // steps x step_seconds
  double eval_seconds = 0;           // all evaluations
  double save_seconds = 0;           // one checkpoint's stall (delta)
  /// The recovery-aware period Tc (save included; 0 when M is unknown).
  double checkpoint_interval_seconds = 0;
  double young_interval_seconds = 0;  // Young's sqrt(2 delta M), beside it
  double saves_seconds = 0;           // all saves
  double job_mtbf_seconds = 0;        // per-GPU MTBF / GPUs (0 = failures not modelled)
  double expected_failures = 0;
  double lost_seconds = 0;    // failures x (Tc/2 + restart)
  double drills_seconds = 0;  // restore drills
  double pilot_seconds = 0;
  double margin_seconds = 0;
  double wall_seconds = 0;  // everything, the margin included
  double ettr = 0;          // train_seconds / wall_seconds
};

/// What budget() needs; every figure for the whole job.
struct BudgetInput {
  double steps = 0;                           // optimizer steps
  double compute_seconds_per_step = 0;        // FLOPs / (GPUs x peak x MFU)
  double communication_seconds_per_step = 0;  // exposed (not overlapped) collectives
  double evals = 0;                           // evaluations in the run
  double eval_seconds = 0;                    // one evaluation
  double save_seconds = 0;                    // delta: what one checkpoint save stalls the job
  double restart_seconds = 0;  // R, per failure and per drill: requeue, start, restore, first step
  int64_t gpus = 1;
  double gpu_mtbf_hours = 0;  // per GPU; 0 = failures not modelled (no saves for them either)
  int64_t restore_drills = 0;
  double pilot_seconds = 0;
  double margin_fraction = 0;  // added to everything else
};

/// The whole process (docs/plan.md, "Budget"): work W = steps x step + evals; a save every
/// recovery-aware period Tc (W/(Tc - delta) saves of delta each); failures arrive every
/// M = MTBF/GPUs and each loses Tc/2 + R, so the run takes (W + saves) / (1 - (Tc/2 + R)/M);
/// then drills, the pilot and the margin. wall_seconds is infinite when failures outpace
/// progress.
Budget budget(const BudgetInput& input);

// ---- the plan ----------------------------------------------------------------------------------

/// A pilot's measurements (<run dir>/pilot.json) that calibrate a plan.
struct PilotCalibration {
  std::filesystem::path run_dir;
  std::string job_hash;               // job_hash() of the pilot's config
  std::string device;                 // "cpu" or the CUDA device's name
  double mfu = 0;                     // measured on `device` (0 = unknown)
  double eval_seconds = 0;            // one evaluation, measured
  double write_bytes_per_second = 0;  // checkpoint save, measured
  double activation_ratio = 0;        // measured / estimated activations + logits (0 = none)
  /// A restart as the pilot measured it: process start, restore, first step (0 = none).
  double recovery_seconds = 0;
  double wall_seconds = 0;  // the pilot's own duration
  /// The pilot's measured optimizer step at its world size and the world size (0 = none).
  double step_seconds = 0;
  int64_t world_size = 1;
  /// The device's achievable matmul rate as the pilot timed it (pilot.json "matmul_peak"; 0 =
  /// not measured: a pilot written before the measurement existed).
  double matmul_peak_flops_per_second = 0;
  /// The pilot's measured peak memory of one step (0 = none).
  double peak_memory_bytes = 0;
  /// How step_seconds was timed (pilot.json step_timing.method; "" = an older pilot: its
  /// memory-measured step alone).
  std::string step_timing;
  /// The part of an async save that blocks training (the save call and the staging copy), as the
  /// pilot measured it (0 = not measured: an older pilot).
  double save_blocking_seconds = 0;
  /// The wait for that save to finish after the next step and an evaluation (0 = not measured).
  double save_end_wait_seconds = 0;
};

/// Hash of the config with the [plan] and [pilot] keys at their defaults: what a pilot and a plan
/// of the same job share.
std::string job_hash(const Config& config);

/// Reads <run_dir>/pilot.json. Throws UserError when it is missing or malformed, or when the
/// pilot ran another job (job hashes differ: "kiln pilot" the config first).
PilotCalibration read_pilot(const std::filesystem::path& run_dir, const Config& config);

/// Plans `config` on each hardware row (plan.hardware, else the whole catalog) at plan.gpus
/// GPUs: strategy, step time, days, ETTR, checkpoint interval, 7- and 30-day fit and cost, and the
/// recommendation. Never builds the model. With `require_cost`, a missing price or MTBF is a
/// UserError naming the key. Returns plan.json's content, whole (the plan rung writes it through
/// to_json); status.passed: some row fits a 30-day reservation.
PlanResult make_plan(const Config& config, const PilotCalibration* pilot, bool require_cost);

/// The plan as Markdown: the assumptions, one table row per hardware row, the recommendation.
std::string plan_markdown(const PlanResult& plan);

// ---- measured matmul peak (src/plan/matmul_peak.cpp) -------------------------------------------

/// The GEMM the job's step is made of, timed to find what the device achieves: gpt
/// [micro_batch x seq_len, n_embd] x [n_embd, 4 n_embd] (the MLP's up-projection, the step's
/// largest matmul; llama the same at its hidden size), the mlp [micro_batch, input_dim] x
/// [input_dim, hidden_dim]. m, n, k >= 1.
struct MatmulShape {
  int64_t m = 1, n = 1, k = 1;
};
MatmulShape job_matmul_shape(const ModelShape& shape, const JobShape& job);

/// What a timed GEMM achieved on one device.
struct MatmulPeak {
  double flops_per_second = 0;  // 2 m n k / median_seconds
  MatmulShape shape;
  std::string dtype;          // "float32" | "bfloat16" | "float16": the job's compute precision
  double median_seconds = 0;  // one matmul, synchronized
  int64_t repeats = 0;        // timed repetitions (after two warm-ups)
};
/// Times `shape`'s GEMM in the job's compute precision on `device` ("cpu", "cuda:0") for about
/// `budget_seconds` (at least 5 repetitions), at the calling thread's LibTorch thread count. The
/// baseline and the pilot record it as "matmul_peak" and report MFU against it beside the
/// catalog's peak. Throws std::invalid_argument for an unknown device string.
MatmulPeak measure_matmul_peak(const MatmulShape& shape, std::string_view precision,
                               std::string_view device, double budget_seconds = 0.3);
nlohmann::json to_json(const MatmulPeak& peak);

// ---- forecast of one run, and forecast against actual (src/plan/forecast.cpp) -------------------

/// What the plan model expects of one run of a config on the device it runs on, per device at
/// the run's world size (docs/plan.md, "Forecast against actual").
struct Forecast {
  std::string device;  // the runtime device name ("cpu", "NVIDIA H100 80GB HBM3")
  int64_t world_size = 1;
  std::string calibration;  // "pilot <dir>" or "uncalibrated"
  /// The FLOP/s the step time divides by: peak x MFU. 0 = unknown (no catalog row, no pilot on
  /// this device): no time forecast.
  double peak_flops_per_second = 0;
  std::string peak_source;  // "matmul measured by the pilot", "hardware catalog (h100-sxm)", ...
  double mfu = 0;
  std::string mfu_source;        // "pilot (measured on this device)" or "plan.mfu (assumed)"
  double flops_per_step = 0;     // per device, one optimizer step
  double tokens_per_step = 0;    // per device (samples for the mlp)
  double steps = 0;              // train.steps
  double step_seconds = 0;       // flops_per_step / (peak x mfu); 0 = unknown
  double tokens_per_second = 0;  // per device
  double train_seconds = 0;      // steps x step_seconds
  double peak_memory_bytes = 0;  // the memory model's step peak, calibrated by the pilot
  double memory_calibration = 1;
  double checkpoint_bytes = 0, save_seconds = 0, write_bytes_per_second = 0;
  /// What one save stalls training: with checkpoint.async the blocking part the pilot measured
  /// (the save call and the staging copy; the write runs beside training) and the wait that
  /// finished it after an evaluation (save_stall.h), else the whole save.
  bool async_save = false;  // checkpoint.async
  double save_stall_seconds = 0;
  std::string save_stall_source;  // in words
  /// Time lost to checkpoints over the run: every save's stall and, with async saves and a final
  /// save after the final evaluation (checkpoint.save_final, steps not a multiple of
  /// every_steps), the rest of that save's write, which nothing covers.
  double checkpoint_seconds = 0;
  /// The run as a whole: its evaluations (every train.eval_every steps and one at the end) and
  /// checkpoint saves (every checkpoint.every_steps, and the final one with save_final), each at
  /// its forecast time; wall = train + checkpoint_seconds + evaluations; ETTR = train / wall (no
  /// failures: one run). 0 = unknown (no step time).
  double evals = 0, eval_seconds = 0, saves = 0, wall_seconds = 0, ettr = 0;
  /// plan.price_7d_per_gpu_hour for the device's catalog row (0 = no price), and the run's cost
  /// at it: wall x world_size x price.
  double price_per_gpu_hour = 0, cost = 0;
};

/// The forecast of `config` run on `device_name` with `world_size` processes under `strategy`
/// ("none" | "ddp" | "fsdp"): the plan's formulas, the pilot's measurements when the pilot ran on
/// the same device (its measured matmul peak and the MFU it achieved against it), else the
/// catalog row's peak and plan.mfu.
/// `tp` and `dp_replicate` (0: the config's dist.tp and dist.dp_replicate) are the mesh the
/// memory walk is per rank of.
Forecast forecast_run(const Config& config, const PilotCalibration* pilot,
                      std::string_view device_name, int64_t world_size,
                      std::string_view strategy = "none", int64_t tp = 0, int64_t dp_replicate = 0);

/// The layout a run in `run_dir` trained under: its strategy.json (kiln train records the
/// resolved strategy and mesh there, dist.strategy = "auto"'s choice included) when present, else
/// the config's keys for `world_size` ranks (auto read as ddp, tp and dp_replicate 0 = the keys).
struct RunLayout {
  std::string strategy = "none";  // "none" | "ddp" | "fsdp"
  int64_t tp = 0, dp_replicate = 0;
  std::string source;  // "strategy.json" | "the config (no strategy.json)"
};
RunLayout run_layout(const Config& config, const std::filesystem::path& run_dir,
                     int64_t world_size);
/// One line: "forecast (calibrated by pilot runs/p): step 12.3 ms, 41.6k tokens/s, peak memory
/// 430 MiB, 300 steps in 3.7 s".
std::string forecast_text(const Forecast& forecast);

/// `kiln train`'s start: logs the forecast of the run in `run_dir` (its manifest.json's device
/// and world size), calibrated by the pilot in plan.pilot when set, and when to expect the
/// finish, and returns it (the run tracks itself against it). Advice only: a missing or foreign
/// pilot is a warning (the forecast is then uncalibrated), never an error; nullopt when no
/// forecast could be made. Rank 0 only (others return nullopt).
std::optional<Forecast> log_plan_forecast(const Config& config,
                                          const std::filesystem::path& run_dir, int rank);

/// What a run recorded, as `kiln plan --actual` reads it from the typed rung results. 0 = not
/// recorded.
struct ActualRun {
  std::string run_dir;
  std::string device;
  int64_t world_size = 1;
  double step_seconds = 0;       // median step
  std::string step_source;       // "metrics.jsonl, median of 190 steps", "baseline.json", ...
  double tokens_per_second = 0;  // per device
  double steps = 0;              // steps the run recorded
  double train_seconds = 0;      // their step times summed
  double peak_memory_bytes = 0;
  std::string memory_source;
  double save_seconds = 0;  // one checkpoint save
  /// From the run's last plan-tracking record (metrics.jsonl "plan", kiln train): the wall time
  /// from the first step's start to the end, the time checkpoints stalled it, and ETTR =
  /// productive step time / wall. 0 = not recorded.
  double wall_seconds = 0, checkpoint_seconds = 0, ettr = 0;
};

/// Forecast against actual, row by row: {"rows": [{quantity, forecast, actual, ratio
/// (forecast / actual, null when either is unknown), error ((forecast - actual) / actual, null
/// likewise), input (the forecast input that sets it)}]; the rows: step time, tokens/s, time of
/// the recorded steps, peak memory, checkpoint save, wall time, ETTR, cost (the actual wall x
/// world size x the forecast's price),
/// "most_wrong": {input, ratio, text}}. The most wrong input is the one whose ratio is farthest
/// from 1 (|log ratio|).
nlohmann::json compare_forecast(const Forecast& forecast, const ActualRun& actual);
/// The comparison as Markdown: a table and the most wrong input.
std::string comparison_markdown(const nlohmann::json& comparison);

}  // namespace kiln
