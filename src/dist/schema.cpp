// The [dist] section of the config schema: the process group, DDP, and the scale rung.
#include "core/schema_sections.h"

namespace kiln {

ConfigSection dist_section() {
  return {
      "dist",
      {
          // Runtime
          // ---------------------------------------------------------------------------------
          string_key(
              "dist", "launcher", "auto", {"auto", "torchrun", "slurm", "none"},
              "where rank and world size come from: auto = torchrun's variables when WORLD_SIZE "
              "is set, else Slurm's inside an srun step, else one process"),
          string_key("dist", "backend", "auto", {"auto", "gloo", "nccl"},
                     "collective backend: auto = nccl on CUDA, gloo on CPU"),
          float_key("dist", "timeout_seconds", 300.0, 1.0, 1e6,
                    "rendezvous and collective timeout: a rank that dies or hangs makes the others "
                    "stop within this"),
          string_key("dist", "master_addr", "", {},
                     "host of rank 0's rendezvous store when MASTER_ADDR is unset (Slurm, manual "
                     "launch); torchrun sets MASTER_ADDR itself"),
          int_key("dist", "master_port", 29500, 1, 65535,
                  "port of the rendezvous store when MASTER_PORT is unset"),
          // Data parallelism
          // ------------------------------------------------------------------------
          float_key("dist", "bucket_mb", 25.0, 0.0, 1e6,
                    "gradient all-reduce bucket size in MiB (DDP's bucket_cap_mb); a bucket's "
                    "all-reduce starts during backward as soon as its gradients are ready (0: one "
                    "bucket per parameter)"),
          float_key(
              "dist", "first_bucket_mb", 1.0, 0.0, 1e6,
              "size of the first bucket (the last layers' gradients) in MiB, so communication "
              "starts early in backward"),
          // Strategy and FSDP
          // ---------------------------------------------------------------------------------
          string_key(
              "dist", "strategy", "auto", {"auto", "ddp", "fsdp"},
              "data parallel strategy when world size > 1: ddp replicates the training state on "
              "every rank, fsdp shards parameters, gradients and optimizer state (docs/scale.md); "
              "auto = ddp when its per-device memory fits dist.device_memory_bytes with "
              "dist.memory_headroom, else fsdp"),
          int_key("dist", "dp_replicate", 0, 0, 4096,
                  "fsdp: hybrid sharding (HSDP): the state is sharded over world / dp_replicate "
                  "ranks (consecutive ranks, one node's) and replicated dp_replicate times, the "
                  "gradient shards all-reduced across the replicas; 1 = shard over every rank; 0 "
                  "= auto: 1 with dist.strategy = \"fsdp\", the plan's choice with \"auto\" "
                  "(the smallest shard group that fits, replicated over the rest); must divide "
                  "the world size"),
          int_key("dist", "tp", 0, 0, 4096,
                  "tensor parallelism: each decoder layer split over this many consecutive ranks "
                  "(column-parallel q/k/v and the MLP's up projections, row-parallel the "
                  "attention's output and the MLP's down projection; gpt, llama), data "
                  "parallelism (dist.strategy) over world / tp; must divide the world size; 0 = "
                  "auto: 1 with \"ddp\" or \"fsdp\", the plan's choice with \"auto\" (a tp "
                  "degree inside a node when FSDP does not fit in one node and TP communicates "
                  "less than FSDP across nodes; eager steps, models with a plan)"),
          bool_key("dist", "tp_across_nodes", false,
                   "allow dist.tp larger than the ranks of one node (LOCAL_WORLD_SIZE): its "
                   "all-reduces, two per layer each way, would then cross the network"),
          bool_key("dist", "reshard_after_forward", true,
                   "fsdp: free a unit's gathered parameters after its forward and gather them "
                   "again for backward (ZeRO-3); false keeps them until its backward (ZeRO-2)"),
          string_key("dist", "fsdp_accumulate", "unsharded", {"unsharded", "sharded"},
                     "fsdp with train.grad_accum_steps > 1: unsharded = full gradients kept "
                     "across micro-steps, communication on the last only; sharded = "
                     "reduce-scatter every micro-step (less memory, more traffic)"),
          bool_key("dist", "fsdp_prefetch", true,
                   "fsdp: start the next unit's all-gather before the current unit computes"),
          float_key("dist", "device_memory_bytes", 0.0, 0.0, 1e18,
                    "strategy auto: memory of one device in bytes (0 = the device's total; CPU: "
                    "the machine's)"),
          float_key("dist", "memory_headroom", 0.1, 0.0, 0.99,
                    "strategy auto: fraction of device memory kept free"),
          // The scale rung
          // ---------------------------------------------------------------------------
          int_key(
              "dist", "scale_processes", 0, 0, 4096,
              "scale rung outside torchrun (the ladder, `kiln scale`): launch torchrun "
              "--standalone with this many processes on this node; 0 = the ladder skips the rung"),
          string_key(
              "dist", "torchrun", "", {},
              "scale rung: path of torchrun (empty: PATH, then .venv/bin/torchrun next to the "
              "build directory)"),
          int_key("dist", "scale_warmup_steps", 3, 0, 1e9,
                  "scale rung: distributed steps run before timing starts"),
          int_key("dist", "scale_steps", 20, 2, 1e9, "scale rung: measured distributed steps"),
          int_key("dist", "scale_baseline_steps", 10, 0, 1e9,
                  "scale rung: measured steps of the single-process baseline (rank 0 alone, the "
                  "others waiting); 0 = no baseline, no efficiency"),
          float_key("dist", "min_scaling_efficiency", 0.0, 0.0, 10.0,
                    "scale rung gate: global throughput / (processes x single-process throughput) "
                    "must reach this"),
      },
      {
          {"dist.backend = \"nccl\" needs CUDA, so not run.device = \"cpu\"",
           [](const Config& c) -> std::string {
             if (c.get_string("dist.backend") != "nccl" || c.get_string("run.device") != "cpu")
               return "";
             return "dist.backend = \"nccl\" needs CUDA, but run.device = \"cpu\"; set "
                    "dist.backend = \"gloo\" (or \"auto\") or run.device = \"cuda\"";
           },
           {"dist.backend=nccl", "run.device=cpu"}},
          {"dist.dp_replicate > 1 (hybrid sharding) needs dist.strategy = \"fsdp\"",
           [](const Config& c) -> std::string {
             if (c.get_int("dist.dp_replicate") <= 1 || c.get_string("dist.strategy") == "fsdp")
               return "";
             return "dist.dp_replicate = " + std::to_string(c.get_int("dist.dp_replicate")) +
                    " asks for hybrid sharding, which shards the state, but dist.strategy = \"" +
                    c.get_string("dist.strategy") +
                    "\"; set dist.strategy = \"fsdp\" (or dist.dp_replicate = 0: \"auto\" "
                    "picks the replicas itself)";
           },
           {"dist.dp_replicate=2", "dist.strategy=ddp"}},
          {"dist.tp > 1 needs compile.backend = \"eager\"",
           [](const Config& c) -> std::string {
             if (c.get_int("dist.tp") <= 1 || c.get_string("compile.backend") == "eager") return "";
             return "dist.tp = " + std::to_string(c.get_int("dist.tp")) +
                    " splits each layer with collectives inside it, which a compiled package "
                    "(compile.backend = \"" +
                    c.get_string("compile.backend") +
                    "\") does not run; set compile.backend = \"eager\" or dist.tp = 1";
           },
           {"model.name=llama", "data.name=text", "dist.tp=2", "compile.backend=inductor"}},
      }};
}

}  // namespace kiln
