"""Per-unit compilation (compile.granularity = "unit"): one model unit (a transformer block) as a
pair of AOTInductor packages, its forward and its backward.

kiln_py.compile runs this for a spec whose "graph" is "unit" (docs/compile.md, "Per-unit
compilation"). The unit is the twin's submodule named by spec["unit"], called as
f(input, *parameters) with the parameters in spec["parameters"] order (kiln's ModelUnit order).
AOTAutograd (functorch's aot_function) traces the joint forward+backward graph under the
precision's autocast and partitions it with min_cut_rematerialization_partition, as
torch.compile does for training: the forward graph returns the output and the tensors the
backward needs (the saved tensors); the backward graph takes those and the output's gradient and
returns the gradient of the input and of every parameter. Each graph is exported
(torch.export, non-strict) and packaged by AOTInductor.

Saved tensors that are inputs of the forward (a parameter, the unit's input) are not returned by
the forward package: the result names them ("input" or "parameter:<k>") and kiln passes its own
tensor, so FSDP's regathered parameters are what the backward reads. Before it reports success
the pair is run once on random inputs and its gradients compared with eager autograd's.

The model's root (the parameters outside every unit) is compiled the same way, as two pieces
(ROOT_PIECES): "root.before_units" (gpt: token and position embeddings, f(token ids, *parameters)
-> the first unit's input) and "root.after_units" (final norm, head and loss, f(hidden, targets,
*parameters) -> the loss); their integer inputs (token ids, targets) get no gradient.
"""
import importlib
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from kiln_py import aoti, models

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64}


class UnitSpecError(ValueError):
    """The unit spec is malformed (exit 2)."""


def check_unit_spec(spec, path):
    for key in ("unit", "input", "parameters", "backward_package"):
        if key not in spec:
            raise UnitSpecError(f"{path}: a unit spec needs the key '{key}'")
    if spec["unit"] == "root.after_units" and "targets" not in spec:
        raise UnitSpecError(f"{path}: the root piece after the units needs the key 'targets'")
    tensors = [("input", spec["input"])] + [(f"parameters[{i}]", p)
                                             for i, p in enumerate(spec["parameters"])]
    if "targets" in spec:
        tensors.append(("targets", spec["targets"]))
    for where, t in tensors:
        shape = t.get("shape") if isinstance(t, dict) else None
        if (not isinstance(shape, list) or not all(isinstance(s, int) and s > 0 for s in shape)
                or t.get("dtype") not in DTYPES):
            raise UnitSpecError(f"{path}: {where} needs a shape of positive sizes and a dtype "
                                f"({', '.join(DTYPES)})")
    for i, p in enumerate(spec["parameters"]):
        if not isinstance(p.get("name"), str):
            raise UnitSpecError(f"{path}: parameters[{i}] needs its name inside the unit")


def _random(t, device, generator, high):
    if DTYPES[t["dtype"]] == torch.int64:  # token ids, targets: below the vocabulary
        return torch.randint(0, high, t["shape"], generator=generator).to(device)
    return torch.randn(t["shape"], generator=generator).to(device=device,
                                                             dtype=DTYPES[t["dtype"]])


def leading_args(spec):
    """How many arguments of f come before the parameters: the input, and the targets of the
    root piece after the units."""
    return 2 if "targets" in spec else 1


def example_args(spec, device):
    """The piece's input (and targets) and parameters (spec order) to trace and check with: seeded
    random values of the spec's shapes and dtypes (integers below the vocabulary), parameters
    scaled by 0.1, norm weights near one."""
    generator = torch.Generator().manual_seed(0)
    high = int(spec.get("model", {}).get("vocab_size", 2))
    args = [_random(spec["input"], device, generator, high)]
    if "targets" in spec:
        args.append(_random(spec["targets"], device, generator, high))
    lead = len(args)
    args += [_random(p, device, generator, high) * 0.1 for p in spec["parameters"]]
    for p, a in zip(spec["parameters"], args[lead:]):
        if p["name"].endswith("weight") and ("ln" in p["name"] or "norm" in p["name"]):
            a.add_(1.0)  # norm weights near one, as trained ones are
    return args


def _leaves(args):
    """Fresh autograd leaves of args: the floating ones require a gradient (token ids do not)."""
    return [a.detach().requires_grad_(a.is_floating_point()) for a in args]


def _call(unit, names, lead, args):
    """unit(*args[:lead]) with its parameters (names) taken from args[lead:]."""
    return torch.func.functional_call(unit, dict(zip(names, args[lead:])), tuple(args[:lead]))


def trace_unit(unit, names, args, autocast, lead=1):
    """(forward GraphModule, its example args, backward GraphModule, its example args, eager
    output): AOTAutograd's partition of unit(*args[:lead]) with parameters args[lead:]."""
    from functorch.compile import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs = {}

    def keep(kind):
        def compiler(gm, example):
            graphs[kind] = (gm, list(example))
            return gm
        return compiler

    def fn(*all_args):
        return _call(unit, names, lead, all_args)

    leaves = _leaves(args)
    with autocast:
        compiled = aot_function(fn, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                partition_fn=min_cut_rematerialization_partition)
        out = compiled(*leaves)
    out.backward(torch.ones_like(out))
    return graphs["forward"], graphs["backward"], out


# ---- the root's pieces --------------------------------------------------------------------------
# Each piece is a module holding only the twin's submodules it uses, under the twin's own names
# (so its parameter names are the model's: "transformer.wte.weight"), computing what kiln's C++
# model computes before its first unit and after its last (src/models: SplitForward).

class _GptBeforeUnits(torch.nn.Module):
    def __init__(self, twin):
        super().__init__()
        t = twin.transformer
        self.transformer = torch.nn.ModuleDict(dict(wte=t.wte, wpe=t.wpe))

    def forward(self, idx):
        t = self.transformer
        pos = torch.arange(idx.shape[1], device=idx.device)
        return t.wte(idx) + t.wpe(pos)


class _GptAfterUnits(torch.nn.Module):
    def __init__(self, twin):
        super().__init__()
        t = twin.transformer
        self.transformer = torch.nn.ModuleDict(dict(wte=t.wte, ln_f=t.ln_f))

    def forward(self, x, targets):
        t = self.transformer
        return models.loss(F.linear(t.ln_f(x), t.wte.weight), targets)  # head tied to wte


class _LlamaBeforeUnits(torch.nn.Module):
    def __init__(self, twin):
        super().__init__()
        self.model = torch.nn.ModuleDict(dict(embed_tokens=twin.model.embed_tokens))

    def forward(self, idx):
        return self.model.embed_tokens(idx)


class _LlamaAfterUnits(torch.nn.Module):
    def __init__(self, twin):
        super().__init__()
        self.tied = twin.lm_head is None
        parts = dict(norm=twin.model.norm)
        if self.tied:
            parts["embed_tokens"] = twin.model.embed_tokens
        self.model = torch.nn.ModuleDict(parts)
        self.lm_head = twin.lm_head

    def forward(self, x, targets):
        m = self.model
        head = m.embed_tokens.weight if self.tied else self.lm_head.weight
        return models.loss(F.linear(m.norm(x), head), targets)


ROOT_PIECES = {("gpt", "root.before_units"): _GptBeforeUnits,
               ("gpt", "root.after_units"): _GptAfterUnits,
               ("llama", "root.before_units"): _LlamaBeforeUnits,
               ("llama", "root.after_units"): _LlamaAfterUnits}


def piece_of(model, spec):
    """The module spec["unit"] names: a unit (the twin's submodule of that name) or a root piece."""
    name = spec["unit"]
    if name.startswith("root."):
        kind = ROOT_PIECES.get((spec["model"]["name"], name))
        if kind is None:
            raise UnitSpecError(f"model '{spec['model']['name']}' has no root piece '{name}'")
        return kind(model)
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise UnitSpecError(f"the model has no unit '{name}'")


def split_forward(gm, primals):
    """Rewrites the forward graph's outputs to [output, computed saved tensors...] and says where
    each saved tensor comes from: {"input": k} (the k-th argument of f: 0 the unit's input,
    1 + j parameter j) or {"output": m} (the m-th output of the rewritten forward)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != primals:
        raise RuntimeError(f"the forward graph takes {len(placeholders)} inputs, not {primals}")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(output.args[0])
    out, saved = values[0], values[1:]
    kept, sources = [out], []
    for v in saved:
        if not isinstance(v, torch.fx.Node):
            raise RuntimeError(f"the forward graph saves a non-tensor ({v!r}); only static shapes "
                               f"are compiled per unit")
        if v in placeholders:
            sources.append({"input": placeholders.index(v)})
        elif v in kept:
            sources.append({"output": kept.index(v)})
        else:
            kept.append(v)
            sources.append({"output": len(kept) - 1})
    output.args = (tuple(kept),)
    gm.graph.lint()
    gm.recompile()
    return sources, len(kept)


class _DropNone(torch.nn.Module):
    """The backward graph returning only its defined gradients (AOTInductor takes tensors)."""

    def __init__(self, gm, defined):
        super().__init__()
        self.gm, self.defined = gm, defined

    def forward(self, *args):
        grads = self.gm(*args)
        return tuple(grads[k] for k in self.defined)


def package(module, args, path, configs):
    ep = torch.export.export(module, tuple(args), strict=False)
    return aoti.compile_and_package(ep, path, configs)


# ---- the forward and the backward built side by side ---------------------------------------
#
# The pair's two packages are independent once AOTAutograd has partitioned the joint graph: each is
# exported and built by AOTInductor from its own graph. Built one after the other, most of a
# pair's wall time is two serial C++ builds (a block's wrapper alone is ~5 s of g++ per package on
# these machines), one core idle. On CPU with at least two cores this process forks after the
# partition: the child builds the backward package (its intra-op threads set to one: GNU OpenMP's
# pool does not survive a fork, and a build computes nothing large; its kernels are still
# generated for the parent's thread count), the parent the forward, and
# the parent waits for the child and reads what it reported (its seconds, C++ builds, or its
# error). Both run torch's own unchanged commands on the same graphs as the serial path, so the
# packages are the ones it builds. Not on CUDA (a CUDA context does not survive a fork), not where
# fork is missing; KILN_COMPILE_PAIR_SIDE_BY_SIDE=0 builds them one after the other (the bench's
# control).

def pair_side_by_side(device):
    if device.type != "cpu" or not hasattr(os, "fork"):
        return False
    if os.environ.get("KILN_COMPILE_PAIR_SIDE_BY_SIDE", "1") == "0":
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return cores >= 2


def package_pair(fw, fw_args, bw, bw_args, spec, configs, device, result):
    """Builds the forward package (spec["package"]) and the backward (spec["backward_package"]),
    side by side where pair_side_by_side allows; returns their paths. result["seconds"] gets
    compile_forward, compile_backward and compile_pair (the wall time of both); result["pair"]
    says how they were built."""
    seconds = result["seconds"]
    began = time.perf_counter()
    child = _fork_backward(bw, bw_args, spec, configs) if pair_side_by_side(device) else None
    try:
        with torch.no_grad():
            forward_path = package(fw, fw_args, spec["package"], configs)
        seconds["compile_forward"] = time.perf_counter() - began
    finally:
        out = _wait_backward(*child) if child else None
    if out is None:
        begin = time.perf_counter()
        out = {"path": package(bw, bw_args, spec["backward_package"], configs),
               "seconds": time.perf_counter() - begin}
    elif "error" in out:
        raise RuntimeError(f"building the backward package: {out['error']}")
    else:
        aoti.CPP_BUILDS.extend(out["cpp_builds"])
    seconds["compile_backward"] = out["seconds"]
    seconds["compile_pair"] = time.perf_counter() - began
    result["pair"] = "side by side" if child else "one after the other"
    return forward_path, out["path"]


def _fork_backward(bw, bw_args, spec, configs):
    """Forks the backward package's builder; returns (its pid, the report it writes)."""
    # Inductor's lowering and C++ modules, imported once for both processes (the parent's lowering
    # imports them anyway; the child would import them again on the other core).
    for module in ("torch._inductor.compile_fx", "torch._inductor.codegen.cpp_wrapper_cpu"):
        importlib.import_module(module)
    report = spec["backward_package"] + f".child{os.getpid()}.json"
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child:
        return child, report
    code, out = 1, {"error": "the child stopped before it reported"}
    try:
        # ATen's own work here on one thread (a parallel region after the fork hangs: GNU
        # OpenMP's pool is the parent's), while Inductor generates the kernels for the parent's
        # thread count as the serial path does: its codegen asks torch.get_num_threads()
        # (torch._inductor.utils.parallel_num_threads; setting config.cpp.threads instead changes
        # the code, "omp parallel num_threads(2)").
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        torch.get_num_threads = lambda: threads
        aoti.CPP_BUILDS.clear()
        begin = time.perf_counter()
        path = package(bw, bw_args, spec["backward_package"], configs)
        out = {"path": path, "seconds": time.perf_counter() - begin,
               "cpp_builds": aoti.CPP_BUILDS}
        code = 0
    except BaseException as e:
        traceback.print_exc()
        out = {"error": " ".join(f"{type(e).__name__}: {e}".split())[:600]}
    finally:
        try:
            with open(report, "w") as f:
                json.dump(out, f)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _wait_backward(child, report):
    """Waits for the forked builder; returns its report (an "error" when it wrote none)."""
    _, status = os.waitpid(child, 0)
    try:
        with open(report) as f:
            out = json.load(f)
    except (OSError, ValueError):
        return {"error": f"the backward's builder (a forked child) exited with wait status "
                         f"{status} and wrote no report"}
    os.remove(report)
    return out


def run_unit(spec, result, model, device, autocast, configs, found_graph_breaks):
    """Builds the unit's package pair; fills result; returns the exit status (0 or 3 on graph
    breaks). Raises on any failure of tracing, export or compile."""
    unit = piece_of(model, spec).to(device).train()
    lead = leading_args(spec)
    names = [p["name"] for p in spec["parameters"]]
    own = dict(unit.named_parameters())
    for p in spec["parameters"]:
        if p["name"] not in own or list(own[p["name"]].shape) != p["shape"]:
            raise UnitSpecError(f"unit '{spec['unit']}' has no parameter {p['name']} of shape "
                                f"{p['shape']}")
    if len(names) != len(own):
        raise UnitSpecError(f"unit '{spec['unit']}' has {len(own)} parameters, the spec names "
                            f"{len(names)}")
    args = example_args(spec, device)
    seconds, notes = result["seconds"], result["notes"]

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unit = unit

        def forward(self, *inputs):
            with autocast():
                return self.unit(*inputs)

    if found_graph_breaks(Call(), tuple(args[:lead]), result, where=f" in unit {spec['unit']}"):
        return 3

    begin = time.perf_counter()
    (fw, fw_args), (bw, bw_args), eager_out = trace_unit(unit, names, args, autocast(), lead)
    sources, forward_outputs = split_forward(fw, len(args))
    bw_outputs = list(next(n for n in bw.graph.nodes if n.op == "output").args[0])
    defined = [k for k, g in enumerate(bw_outputs) if g is not None]
    seconds["trace"] = time.perf_counter() - begin

    forward_path, backward_path = package_pair(fw, fw_args, _DropNone(bw, defined), bw_args,
                                               spec, configs, device, result)

    begin = time.perf_counter()
    check_pair(forward_path, backward_path, sources, defined, unit, names, args, autocast,
               device, notes, lead)
    seconds["check"] = time.perf_counter() - begin

    result["package"] = forward_path
    result["backward_package"] = backward_path
    result["forward_outputs"] = forward_outputs
    result["saved"] = sources
    result["tangents"] = len(bw_args) - len(sources)
    result["gradients"] = defined  # output k of the backward: the gradient of argument defined[k]
    result["output"] = {"shape": list(eager_out.shape), "dtype": str(eager_out.dtype)[6:]}
    result["inputs"] = ["input"] + ["targets"] * (lead - 1) + [f"parameter:{n}" for n in names]
    result["status"] = "ok"
    return 0


def check_pair(forward_path, backward_path, sources, defined, unit, names, args, autocast, device,
               notes, lead=1):
    """Runs the built pair as kiln will (saved tensors routed by `sources`) and compares output
    and gradients with eager autograd under the same autocast. Raises on a mismatch."""
    from torch._inductor import aoti_load_package
    index = 0 if device.type == "cuda" else -1
    forward = aoti_load_package(forward_path, device_index=index)
    backward = aoti_load_package(backward_path, device_index=index)
    with torch.no_grad():
        outs = forward.loader.run(list(args))
    saved = [args[s["input"]] if "input" in s else outs[s["output"]] for s in sources]
    tangent = torch.ones_like(outs[0])
    with torch.no_grad():
        grads = backward.loader.run(saved + [tangent])
    compare_with_eager(outs[0], grads, defined, unit, names, args, autocast, device, notes,
                       lead=lead)


def compare_with_eager(output, grads, defined, unit, names, args, autocast, device, notes,
                       tolerance=None, lead=1):
    """The pair's output and gradients (grads[k]: the gradient of argument defined[k]) against
    eager autograd's on the same arguments under the same autocast; with low-precision arguments,
    a difference over the tolerance (None: the arguments' and autocast's, below) is judged against
    float32. Raises on a mismatch."""
    out, eager_grads = _autograd(unit, names, args, autocast(), lead)
    # A plumbing error (saved tensors out of order, a gradient on the wrong argument) is off by
    # the whole value; rounding differs by far less: fp32 1e-4; autocast with fp32 parameters
    # 3e-2; bf16/fp16 parameters (FSDP's param_dtype) 1e-1 (reductions such as a bias gradient
    # over B*T positions round in the low precision: 4.7e-2 measured on gpt's ln_1.bias at
    # 8 x 32 positions, 0.12 at 8 x 64 x 128).
    low = any(a.is_floating_point() and a.dtype != torch.float32 for a in args)
    if tolerance is not None:
        pass
    elif low:
        tolerance = 1e-1
    elif out.dtype != torch.float32 or autocast().__class__.__name__ == "autocast":
        tolerance = 3e-2
    else:
        tolerance = 1e-4
    pairs = [("output", output, out, None)]
    pairs += [(f"gradient {k}", g, eager_grads[k], k) for k, g in zip(defined, grads)]
    reference = None
    worst = 0.0
    for what, got, want, k in pairs:
        error = _relative(got, want)
        if error > tolerance and low:
            # Over the tolerance in low precision: both sides round, so judge each against the
            # same computation in float32 (from the same low-precision inputs). Rounding leaves
            # the compiled pair about as far from it as eager; a plumbing error is off by O(1).
            if reference is None:
                reference = _autograd(unit, names, [a.float() if a.is_floating_point() else a
                                                    for a in args],
                                      torch.autocast(device.type, enabled=False), lead)
            exact = reference[0] if k is None else reference[1][k]
            compiled_error, eager_error = _relative(got, exact), _relative(want, exact)
            notes.append(f"{what}: {error:.3g} from eager; against float32, compiled "
                         f"{compiled_error:.3g}, eager {eager_error:.3g}")
            if compiled_error > max(2 * eager_error, tolerance):
                raise RuntimeError(
                    f"the compiled unit's {what} differs from eager autograd by {error:.3g} of "
                    f"its largest value (tolerance {tolerance}) and from float32 by "
                    f"{compiled_error:.3g} (eager: {eager_error:.3g})")
            error = tolerance  # as close to float32 as eager: rounding
        worst = max(worst, error)
        if error > tolerance:
            raise RuntimeError(f"the compiled unit's {what} differs from eager autograd by "
                               f"{error:.3g} of its largest value (tolerance {tolerance})")
    notes.append(f"unit pair checked against eager autograd: worst relative error {worst:.2e}")


def _autograd(unit, names, args, autocast, lead=1):
    """Eager autograd's output and gradients of unit(*args[:lead]) with parameters args[lead:]
    (None for an integer argument)."""
    leaves = _leaves(args)
    with autocast:
        out = _call(unit, names, lead, leaves)
    out.backward(torch.ones_like(out))
    return out, [leaf.grad for leaf in leaves]


def _relative(got, want):
    """max |got - want| over max |want|."""
    scale = want.float().abs().max().item() or 1.0
    return (got.float() - want.float()).abs().max().item() / scale
