#!/usr/bin/env python3
"""Python DistributedDataParallel or FSDP2 (Gloo) on kiln's model and data, for the scale benchmark.

Run under torchrun, one process per rank:

    torchrun --standalone --nproc-per-node=2 bench/scale/ddp_peer.py --export <dir> \
             --steps 30 --result <file.json>

<dir> is `kiln peer export <config> --set train.batch_size=<B x world>`: the resolved config, the
initial weights and the global batches. Rank r trains on rows r, r+W, r+2W, ... of every global
batch, which is exactly the shard kiln's DistributedSampler gives rank r with per-rank batch B, so
both sides see the same data in the same order. Each step is what kiln's step does: forward,
backward (DDP's bucketed all-reduce overlapped with it; no_sync on all but the last micro-step),
clipping on the global norm, the optimizer, and the loss averaged over the ranks for logging.
Rank 0 writes per-step losses and step times.

With --fsdp: FSDP2 instead of DDP, `fully_shard` on each of kiln's units (gpt's blocks, the mlp's
layers) and then on the root (embeddings, final norm, tied head), as kiln's FSDP groups them;
set_requires_gradient_sync(False) on all but the last micro-step (kiln's "unsharded" accumulation).
With --fsdp, for bench/compile/fsdp.py (torchtitan's recipe): --checkpoint wraps each block in
checkpoint_wrapper, --compile-units compiles each block with torch.compile (after the wrapper, before
fully_shard), --bf16 gives fully_shard MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32) and runs the forward and loss under torch.autocast(cpu, bfloat16), as kiln's
train.precision = "bf16-mixed" under FSDP does (bf16 gathers, fp32 shards, gradients and optimizer).
"""
import argparse
import json
import os
import resource
import sys
import time
import tomllib
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peer"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
from kiln_py import models  # noqa: E402  (kiln's Python model twins)
from peer import learning_rate, make_optimizer  # noqa: E402  (the peer's optimizer and schedule)


def clip_mixed(params, max_norm, tp_group):
    """clip_grad_norm_ over tensor-parallel DTensor slices and plain (replicated) parameters,
    which torch.nn.utils.clip_grad_norm_ refuses to mix: the slices' squared norms summed over
    the tp group, the replicated ones' once (as torchtitan's clip_grad_norm_ does per mesh)."""
    from torch.distributed.tensor import DTensor
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    # A DTensor replicated over the tp group (RowwiseParallel's bias) counts once, as a plain one.
    sliced = [isinstance(g, DTensor) and any(p.is_shard() for p in g.placements) for g in grads]
    split = sum((t.float().norm() ** 2 for t, s in zip(local, sliced) if s), torch.zeros(()))
    whole = sum((t.float().norm() ** 2 for t, s in zip(local, sliced) if not s), torch.zeros(()))
    dist.all_reduce(split, group=tp_group)
    total = (split + whole).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for t in local:
        t.mul_(coef)


def gpt_rows_by_rank(c_attn, tp):
    """Reorders gpt's fused c_attn rows [q; k; v] to [q_0; k_0; v_0; q_1; ...] (q_r: rank r's
    heads' rows), so ColwiseParallel's even split on dim 0 gives each rank its heads' q, k and v,
    as kiln's fused placement does; the same math, rows permuted."""
    with torch.no_grad():
        for p in (c_attn.weight, c_attn.bias):
            blocks = p.view(3, tp, p.shape[0] // (3 * tp), *p.shape[1:])
            p.copy_(blocks.transpose(0, 1).reshape(p.shape))


def gpt_local_attention(self, x):
    """kiln_py.models.Attention.forward on this rank's heads (its c_attn output is 3 x C / tp)."""
    B, T, _ = x.shape
    q, k, v = self.c_attn(x).chunk(3, dim=2)
    width = q.shape[-1]
    q, k, v = (t.view(B, T, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, width))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--export", required=True, help="a `kiln peer export` directory")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--result", required=True, help="rank 0 writes losses and step times here")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP")
    parser.add_argument("--checkpoint", action="store_true", help="--fsdp: checkpoint_wrapper per block")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor parallelism over this many ranks (parallelize_module over a "
                             "DeviceMesh, heads divided, as torchtitan; llama: ColwiseParallel "
                             "q/k/v/gate/up, RowwiseParallel o/down; gpt: ColwiseParallel c_attn "
                             "(rows regrouped by rank) and c_fc, RowwiseParallel the c_projs); the "
                             "data-parallel ranks "
                             "(world / tp) run DDP; no --fsdp")
    parser.add_argument("--replicate", type=int, default=1,
                        help="--fsdp: hybrid sharding over a 2-D DeviceMesh (replicate, shard) with this "
                             "many replicas (fully_shard(mesh=...): HSDP)")
    parser.add_argument("--compile-units", action="store_true", help="--fsdp: torch.compile per block")
    parser.add_argument("--bf16", action="store_true",
                        help="--fsdp: MixedPrecisionPolicy(bf16 params, fp32 reduce) and autocast(bf16)")
    args = parser.parse_args()
    if args.tp > 1 and args.fsdp:
        parser.error("--tp goes without --fsdp here")
    if (args.checkpoint or args.compile_units or args.bf16 or args.replicate > 1) and not args.fsdp:
        parser.error("--checkpoint, --compile-units, --bf16 and --replicate go with --fsdp")

    with open(os.path.join(args.export, "config.toml"), "rb") as f:
        cfg = tomllib.load(f)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=cfg["dist"]["timeout_seconds"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg["run"]["threads"] > 0:
        torch.set_num_threads(cfg["run"]["threads"])
    if cfg["run"]["deterministic"]:
        torch.use_deterministic_algorithms(True, warn_only=True)

    model = models.from_config(cfg["model"])
    model.load_state_dict(load_file(os.path.join(args.export, "init.safetensors")), strict=True)
    model.train()
    if args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16
                  else MixedPrecisionPolicy())
        blocks = model.transformer.h if hasattr(model, "transformer") else None
        if blocks is None and (args.checkpoint or args.compile_units):
            raise SystemExit("--checkpoint and --compile-units need a model with blocks (gpt)")
        units = list(blocks) if blocks is not None else [model.fc1, model.fc2]
        mesh = None
        if args.replicate > 1:  # HSDP: shard inside each row of the mesh, replicate across rows
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (args.replicate, world // args.replicate),
                                    mesh_dim_names=("replicate", "shard"))
        for i, unit in enumerate(units):
            if args.checkpoint:
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
                unit = blocks[i] = checkpoint_wrapper(unit)
            if args.compile_units:
                unit.compile()
            fully_shard(unit, reshard_after_forward=cfg["dist"].get("reshard_after_forward", True),
                        mp_policy=policy, mesh=mesh)
        ddp = fully_shard(model, mp_policy=policy, mesh=mesh)
    elif args.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        if hasattr(model, "transformer"):  # gpt: c_attn stacks q, k, v on its output rows
            plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                    "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
            for block in model.transformer.h:
                gpt_rows_by_rank(block.attn.c_attn, args.tp)
                parallelize_module(block, mesh["tp"], plan)
                block.attn.heads //= args.tp
                block.attn.forward = types.MethodType(gpt_local_attention, block.attn)
        else:
            plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
            plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                         "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
            for layer in model.model.layers:
                parallelize_module(layer, mesh["tp"], plan)
                layer.self_attn.heads //= args.tp
                layer.self_attn.kv_heads //= args.tp
        if world // args.tp > 1:
            raise SystemExit("--tp with data parallelism: not in this peer (kiln's TP x DDP has no peer here)")
        ddp = model
    else:
        ddp = DistributedDataParallel(model, bucket_cap_mb=cfg["dist"]["bucket_mb"])
    optimizer = make_optimizer(model, cfg["optim"])
    if args.tp > 1:  # fused kernels refuse DTensor slices and plain tensors in one group
        from torch.distributed.tensor import DTensor
        groups = []
        for g in optimizer.param_groups:
            for keep in (True, False):
                ps = [p for p in g["params"] if isinstance(p, DTensor) == keep]
                if ps:
                    groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ps})
        optimizer = type(optimizer)(groups)  # each group carries its own options
    accum = cfg["train"]["grad_accum_steps"]
    clip = cfg["train"]["clip_grad_norm"]
    params = list(model.parameters())

    batches = load_file(os.path.join(args.export, "batches.safetensors"))
    dp_rank, dp_world = rank // args.tp, world // args.tp  # a tp group reads the same batch
    shards = [[(batches[f"step{k}.micro{m}.inputs"][dp_rank::dp_world].contiguous(),
                batches[f"step{k}.micro{m}.targets"][dp_rank::dp_world].contiguous()) for m in range(accum)]
              for k in range(args.steps)]
    del batches

    losses, seconds, cpu_seconds = [], [], []
    for k in range(args.steps):
        begin, cpu_begin = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for m, (inputs, targets) in enumerate(shards[k]):
            last = m == accum - 1
            if args.fsdp:
                ddp.set_requires_gradient_sync(last)
            with (ddp.no_sync() if not last and not args.fsdp and args.tp == 1 else torch.enable_grad()):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                    logits = ddp(inputs)
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) / accum
                loss.backward()
            total += loss.detach()
        if clip > 0 and args.tp > 1:
            clip_mixed(params, clip, mesh["tp"].get_group())
        elif clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, k)
        optimizer.step()
        dist.all_reduce(total)  # the logged loss: the mean over every rank, as kiln logs it
        losses.append(total.item() / world)
        seconds.append(time.perf_counter() - begin)
        cpu_seconds.append(time.process_time() - cpu_begin)  # every thread of this process

    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"losses": losses, "strategy": "fsdp2" if args.fsdp else ("tp" if args.tp > 1 else "ddp"), "step_seconds": seconds, "cpu_seconds": cpu_seconds,
                       "world_size": world,
                       "threads": torch.get_num_threads(), "torch": torch.__version__,
                       # this process's peak resident set (Linux reports KiB)
                       "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f)
    # Every rank past its last collective before the group goes, then out without interpreter
    # finalization: FSDP2 on Gloo sometimes aborted at teardown ("terminate called without an
    # active exception", once in a CI run even after barrier + destroy_process_group): Gloo's
    # worker threads can still hold work objects whose tensors reach back into Python while the
    # interpreter is torn down (pytorch/pytorch PR 179291 describes it). The result is written
    # and closed above; nothing is left for finalization to do.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
