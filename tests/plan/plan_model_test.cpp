// The plan's analytic model of a model: its parameters, FLOPs, state bytes and tensor-parallel
// figures against the built models, and the strategies it plans from them (docs/plan.md).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kiln/error.h"
#include "kiln/models.h"
#include "kiln/plan.h"
#include "plan/catalog_fixture.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

Config model_config(const std::vector<std::string>& overrides) {
  Config config = Config::defaults();
  for (const auto& o : overrides) config.set_from_string(o);
  config.validate();
  return config;
}

Config gpt_6_7b_config() {
  return Config::load(source_dir() / "configs" / "gpt-6.7b.toml");
}
// Tensor parallelism in the plan: the degrees a model's plan accepts come from its spec (llama 3
// 8B's 8 key/value heads and 14336-wide MLP: 2, 4, 8), the sliced fraction from its math
// (q/k/v/o and gate/up/down: all but the norms, embedding and head); gpt's from its heads.
TEST(PlanModel, TensorParallelDegreesAndFractionComeFromTheModel) {
  const Config llama = Config::load(source_dir() / "configs" / "llama3-8b.toml");
  const ModelShape shape = model_shape(llama);
  EXPECT_EQ(shape.tensor_parallel_degrees, (std::vector<int64_t>{2, 4, 8}));
  JobShape job = job_shape(llama);
  job.world_size = 16;
  const StrategyInput in = strategy_input(shape, job, 141e9, 0.1);
  // 32 x (4096 x 4096 x 2 + 2 x 4096 x 1024 + 3 x 4096 x 14336) / 8,030,261,248 = 0.8692.
  EXPECT_NEAR(in.tensor_parallel_fraction, 6'979'321'856.0 / 8'030'261'248.0, 1e-9);
  // The embeddings and head (2 x 128256 x 4096 + 4096) stay whole at every degree: the unit.
  EXPECT_DOUBLE_EQ(in.tensor_parallel_unit_bytes.at(8), 4.0 * (2.0 * 128256 * 4096 + 4096));
  // 4 all-reduces per layer of [1, 8192, 4096] in bf16 per micro-batch.
  EXPECT_DOUBLE_EQ(in.tensor_parallel_bytes, 4.0 * 32 * 8192 * 4096 * 2);
  // gpt's plan splits whole heads (32): 2 to 32; its blocks but the norms and the row-parallel
  // biases: 32 x (12 x 4096^2 + 7 x 4096) / 6,583,623,680 = 0.9787.
  const ModelShape gpt = model_shape(gpt_6_7b_config());
  EXPECT_EQ(gpt.tensor_parallel_degrees, (std::vector<int64_t>{2, 4, 8, 16, 32}));
  EXPECT_NEAR(strategy_input(gpt, job_shape(gpt_6_7b_config()), 80e9, 0.1).tensor_parallel_fraction,
              6'443'368'448.0 / 6'583'623'680.0, 1e-9);
  // A model without a plan (the mlp) offers no degree.
  const Config mlp = model_config({"model.name=mlp"});
  EXPECT_TRUE(
      strategy_input(model_shape(mlp), job_shape(mlp), 80e9, 0.1).tensor_parallel_degrees.empty());
}

// configs/llama3-70b.toml on two nodes of 8 H200 (docs/plan.md works it by hand): DDP holds the
// state and the whole model's bf16 copies; FSDP inside a node needs 170.1 GB > 126.9 usable; of
// the layouts past one node, tp 8 x FSDP 2 moves the least (23.1 s a step against FSDP over 16's
// 254 s). The control: the same job on MI300X (172.8 GB usable) shards inside a node.
TEST(PlanModel, Llama70bPlansTensorParallelInsideANodeAndFsdpAcross) {
  const Config config = Config::load(source_dir() / "configs" / "llama3-70b.toml");
  const ModelShape shape = model_shape(config);
  const double n = 70'553'706'496.0;
  EXPECT_EQ(analytic_parameter_count(shape), 70'553'706'496);
  JobShape job = job_shape(config);
  EXPECT_EQ(job.world_size, 16);
  const auto catalog = load_catalog();
  const Device& h200 = find_device(catalog, "h200-sxm", "test");
  StrategyInput in = strategy_input(shape, job, h200.memory_bytes, 0.1);
  in.gpus_per_node = h200.gpus_per_node;
  in.intra_node_bytes_per_second = h200.interconnect_bytes_per_second / 2;
  in.inter_node_bytes_per_second = h200.network_bytes_per_second;
  EXPECT_DOUBLE_EQ(in.ddp_model_state_bytes, 16 * n);
  EXPECT_NEAR(in.weight_copy_bytes, 139.0e9, 0.05e9);
  EXPECT_NEAR(in.activation_bytes, 20.6e9, 0.05e9);
  EXPECT_NEAR(in.tensor_parallel_fraction, 68'451'041'280.0 / n, 1e-12);
  const StrategyDecision d = choose_strategy(in);
  EXPECT_EQ(d.strategy, "fsdp");
  EXPECT_EQ(d.tp_degree, 8);
  EXPECT_EQ(d.fsdp_degree, 2);
  EXPECT_NEAR(d.fsdp_bytes_per_device, 114.3e9, 0.05e9);
  EXPECT_NEAR(d.communication_seconds, 23.1, 0.05);
  EXPECT_THAT(d.reason, HasSubstr("inside a node (over 8) needs 170.1 GB/device"));
  EXPECT_THAT(d.reason, HasSubstr("fsdp over 16 254 s"));
  const Device& mi300x = find_device(catalog, "mi300x", "test");
  StrategyInput amd = strategy_input(shape, job, mi300x.memory_bytes, 0.1);
  amd.gpus_per_node = mi300x.gpus_per_node;
  const StrategyDecision m = choose_strategy(amd);
  EXPECT_EQ(m.tp_degree, 1);
  EXPECT_EQ(m.fsdp_degree, 8);
}

TEST(PlanModel, AnalyticParameterCountEqualsBuiltModels) {
  const std::vector<std::vector<std::string>> cases = {
      {"model.name=gpt", "data.name=text", "model.preset=tiny"},
      {"model.name=gpt", "data.name=text", "model.preset=small"},
      {"model.name=gpt", "data.name=text", "model.preset=tiny", "model.n_layer=3",
       "model.n_embd=96", "model.n_head=3", "model.vocab_size=300", "model.block_size=64",
       "data.seq_len=64"},
      {"model.name=mlp"},
      {"model.name=mlp", "model.input_dim=7", "model.hidden_dim=33", "model.num_classes=5"},
      {"model.name=llama", "data.name=text", "model.preset=llama-tiny"},
      {"model.name=llama", "data.name=text", "model.preset=llama-tiny",
       "model.tie_embeddings=true"},
      {"model.name=llama", "data.name=text", "model.preset=llama-small"},
  };
  for (const auto& overrides : cases) {
    const Config config = model_config(overrides);
    EXPECT_EQ(analytic_parameter_count(model_shape(config)), parameter_count(*make_model(config)))
        << config.to_toml(false);
  }
}

TEST(PlanModel, FlopsPerTokenMatchTheModel) {
  const Config config = model_config({"model.name=gpt", "data.name=text", "model.preset=small"});
  const auto model = make_model(config);
  const int64_t seq = config.get_int("data.seq_len");
  EXPECT_DOUBLE_EQ(train_flops_per_token(model_shape(config), seq) * static_cast<double>(seq),
                   model->train_flops_per_sample(seq));
  // Activation checkpointing adds one forward, worked by hand for a 7-33-5 MLP: N = 7 x 33 + 33 +
  // 33 x 5 + 5 = 434 parameters, 6 N = 2,604 FLOPs a sample trained, 8 N = 3,472 recomputing.
  const Config mlp = model_config(
      {"model.name=mlp", "model.input_dim=7", "model.hidden_dim=33", "model.num_classes=5"});
  EXPECT_DOUBLE_EQ(train_flops_per_token(model_shape(mlp), 1), 2604.0);
  EXPECT_DOUBLE_EQ(train_flops_per_token(model_shape(mlp), 1, true), 3472.0);
  // Its largest unit: fc1's 7 x 33 + 33 = 264 (fc2 holds 33 x 5 + 5 = 170).
  EXPECT_EQ(largest_unit_parameter_count(model_shape(mlp)), 264);
}

// The plan knows a model only through its ModelSpec::math: a model of another name whose math
// is gpt's and names gpt's step layout is planned exactly as gpt (memory, FLOPs, the GEMM, the
// strategy rule's input); the same math naming no layout gets the generic estimate instead.
TEST(PlanModel, AModelIsPlannedFromItsMathNotItsName) {
  const std::vector<std::string> shape = {"data.name=text", "model.preset=tiny", "data.seq_len=64",
                                          "train.batch_size=4"};
  std::vector<std::string> gpt_overrides = shape;
  gpt_overrides.push_back("model.name=gpt");
  const Config gpt = model_config(gpt_overrides);
  const ModelMath math = model_math(gpt);
  ASSERT_EQ(math.step_layout, ModelMath::StepLayout::kGptDecoder);
  for (const auto& [name, layout] :
       {std::pair{"test-plan-twin", ModelMath::StepLayout::kGptDecoder},
        std::pair{"test-plan-generic", ModelMath::StepLayout::kGeneric}}) {
    if (find_model(name)) continue;
    ModelSpec spec;
    spec.name = name;
    spec.input = ModelInput::kTokens;
    spec.build = [](const Config&, at::Generator&) -> std::shared_ptr<Model> {
      throw UserError("planned, never built");
    };
    spec.vocab_size = [math](const Config&) { return math.vocab_size; };
    spec.math = [math, layout](const Config&) {
      ModelMath m = math;
      m.step_layout = layout;
      return m;
    };
    register_model(spec);
  }
  auto planned = [&](const std::string& name) {
    std::vector<std::string> o = shape;
    o.push_back("model.name=" + name);
    return model_config(o);
  };
  const Config twin = planned("test-plan-twin"), generic = planned("test-plan-generic");
  const JobShape job = job_shape(gpt);
  const MemoryEstimate expected = estimate_memory(model_shape(gpt), job);
  const MemoryEstimate got = estimate_memory(model_shape(twin), job_shape(twin));
  EXPECT_DOUBLE_EQ(got.step_peak(), expected.step_peak());
  EXPECT_DOUBLE_EQ(got.activations, expected.activations);
  EXPECT_EQ(got.peak_at, expected.peak_at);
  EXPECT_DOUBLE_EQ(train_flops_per_token(model_shape(twin), 64),
                   train_flops_per_token(model_shape(gpt), 64));
  EXPECT_EQ(job_matmul_shape(model_shape(twin), job).n, job_matmul_shape(model_shape(gpt), job).n);
  EXPECT_DOUBLE_EQ(strategy_input(model_shape(twin), job, 80e9, 0.1).activation_bytes,
                   strategy_input(model_shape(gpt), job, 80e9, 0.1).activation_bytes);
  // The control: no layout named, the generic estimate (no activations known: held state and
  // gradients only), which differs from the walk.
  const MemoryEstimate plain = estimate_memory(model_shape(generic), job_shape(generic));
  EXPECT_NE(plain.step_peak(), expected.step_peak());
  EXPECT_DOUBLE_EQ(plain.parameters, expected.parameters);
}

// The walk per rank of a mesh (JobShape::tp, dp_replicate; the pilot compares it with what a
// rank measures, tests/dist/dist_cases.py pilot_mesh): under TP 2 a rank holds its half of each
// split weight (the whole rest) and its half of the heads' and MLP's activations; under HSDP
// the shards of its shard group, as FSDP over that group alone.
TEST(PlanModel, TheMemoryWalkIsOneRanksShareOfTheMesh) {
  for (const char* name : {"gpt", "llama"}) {
    SCOPED_TRACE(name);
    const Config config = model_config({std::string("model.name=") + name, "data.name=text"});
    const ModelShape shape = model_shape(config);
    const double n = static_cast<double>(analytic_parameter_count(shape));
    const double split = static_cast<double>(shape.math_tensor_parallel_parameters);
    ASSERT_GT(split, 0);
    JobShape job = job_shape(config);
    job.world_size = 4;
    job.strategy = "ddp";
    const MemoryEstimate whole = estimate_memory(shape, job);
    job.tp = 2;
    const MemoryEstimate sliced = estimate_memory(shape, job);
    EXPECT_DOUBLE_EQ(whole.parameters, 4.0 * n);
    EXPECT_DOUBLE_EQ(sliced.parameters, 4.0 * (n - split / 2));
    EXPECT_LT(sliced.step_peak() - sliced.parameters - sliced.optimizer - sliced.communication,
              whole.step_peak() - whole.parameters - whole.optimizer - whole.communication);
    job.strategy = "fsdp";  // TP 2 x FSDP 2: the slices sharded over 2
    EXPECT_NEAR(estimate_memory(shape, job).parameters, 4.0 * (n - split / 2) / 2, 0.01 * n);
    job.tp = 1;
    job.dp_replicate = 2;  // HSDP 2 x 2: as FSDP over 2
    const MemoryEstimate hybrid = estimate_memory(shape, job);
    JobShape two = job;
    two.world_size = 2;
    two.dp_replicate = 1;
    EXPECT_DOUBLE_EQ(hybrid.step_peak(), estimate_memory(shape, two).step_peak());
    job.dp_replicate = 1;  // the control: FSDP over all 4 holds less
    EXPECT_LT(estimate_memory(shape, job).parameters, hybrid.parameters);
  }
}

// llama through its ModelSpec::math: the model's own FLOP count, and Llama 3 8B's published
// shape by hand (docs/models.md): N = 2 x 128,256 x 4,096 + 32 x (2 x 4,096 x 4,096 + 2 x 4,096 x
// 1,024 + 3 x 4,096 x 14,336 + 2 x 4,096) + 4,096 = 8,030,261,248; per token at T = 8,192:
// 6 x (N - 525,336,576) + 12 x 32 x 4,096 x 8,192 = 57,914,449,920 FLOPs; the largest unit the
// root (two embeddings and the norm, 1,050,677,248) over a layer (218,112,000).
TEST(PlanModel, LlamaIsPlannedFromItsOwnMath) {
  const Config tiny =
      model_config({"model.name=llama", "data.name=text", "model.preset=llama-tiny"});
  const int64_t seq = tiny.get_int("data.seq_len");
  EXPECT_DOUBLE_EQ(train_flops_per_token(model_shape(tiny), seq) * static_cast<double>(seq),
                   make_model(tiny)->train_flops_per_sample(seq));
  Config big = Config::load(source_dir() / "configs" / "llama3-8b.toml");
  const ModelShape shape = model_shape(big);
  EXPECT_EQ(shape.architecture, "llama");
  EXPECT_EQ(shape.n_kv_head, 8);
  EXPECT_EQ(shape.intermediate_size, 14336);
  EXPECT_EQ(analytic_parameter_count(shape), 8'030'261'248);
  EXPECT_DOUBLE_EQ(train_flops_per_token(shape, 8192), 57'914'449'920.0);
  EXPECT_EQ(largest_unit_parameter_count(shape), 1'050'677'248);
  // The job's GEMM is the gate/up projection: [b s, 4096] x [4096, 14336].
  EXPECT_EQ(job_matmul_shape(shape, job_shape(big)).n, 14336);
}

TEST(PlanModel, StateBytesPerParameter) {
  JobShape job;
  EXPECT_EQ(state_bytes_per_parameter(job), 16);  // fp32 AdamW: 4 + 4 + 8
  job.precision = "bf16";
  EXPECT_EQ(state_bytes_per_parameter(job), 16);  // fp32 master state: the saving is activations
  job.optimizer = "sgd";
  EXPECT_EQ(state_bytes_per_parameter(job), 8);
  job.momentum = true;
  EXPECT_EQ(state_bytes_per_parameter(job), 12);
}

}  // namespace
}  // namespace kiln::testing
