"""Compile a kiln model's training (or eval) step with AOTInductor into a .pt2 package.

    PYTHONPATH=<repo>/python python -m kiln_py.compile --spec SPEC.json --result RESULT.json

kiln's C++ side writes SPEC.json, runs this once per package (never in the step loop) and reads
RESULT.json, which is always written, also on errors. See docs/compile.md, "The Python side", for
both formats. Exit status: 0 compiled, 3 graph breaks (nothing compiled), 2 bad spec or unknown
model (one line on stderr too), 1 any other failure (export, joint graph or compile).

Steps: build the model's Python twin (random weights: the package does not embed them, kiln binds
its own tensors to the package's constants by name) -> torch._dynamo.explain lists every graph
break with its reason and place -> torch.export.export with the spec's dynamic dimensions ->
for "train" the joint forward+backward graph (loss, then every parameter's gradient) ->
torch._inductor.aoti_compile_and_package with the weights left out of the shared library.

A spec whose "graph" is "unit" builds one model unit's forward and backward packages instead
(compile.granularity = "unit"; kiln_py.compile_units has the steps).

Precision (spec "precision"): "bf16-mixed" and "fp16-mixed" export the forward and the loss under
torch.autocast(device, bfloat16 / float16), the policy kiln's eager step runs under (ATen's
autocast op lists, which kiln's C++ autocast guard uses too): the autocast regions become part of
the graph, the parameters stay float32 and their gradients come back float32. "fp16-mixed" adds a
third input, the loss scaler's scale (float32 [1]), and the joint graph differentiates
loss x scale, so small fp16 gradients do not underflow inside the graph; its loss output is
loss x scale too. The scaler itself (unscale, overflow check, growth and back-off) stays kiln's.
"""
import argparse
import contextlib
import json
import logging
import os
import re
import sys
import time
import traceback
import warnings

_BEFORE_TORCH = time.perf_counter()
import torch  # noqa: E402 (its import is timed: part of every cold compile's cost)

IMPORT_TORCH_SECONDS = time.perf_counter() - _BEFORE_TORCH

from kiln_py import aoti, compile_units, models  # noqa: E402

EXIT_OK, EXIT_FAILED, EXIT_BAD_SPEC, EXIT_GRAPH_BREAKS = 0, 1, 2, 3

# The package must not embed the weights (kiln binds its own with
# load_constants(user_managed=true)), and must keep every parameter as a named constant: without
# always_keep_tensor_constants small 1-D parameters can be inlined, so silently frozen.
INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False,
                    "always_keep_tensor_constants": True}


def inductor_configs(device):
    """INDUCTOR_CONFIGS for a package on device. On CPU the wrapper (the graph's run function and
    AOTInductor's runtime, 3 MB of shared library for a gpt block) is compiled at -O0 instead of
    AOTInductor's default -O1: it only calls the kernels and ATen, so the step is no slower
    (gpt small bf16 + AC unit mode, 3 alternations of 8 warm steps: medians 750.7, 743.7, 743.4 ms
    at -O0 beside 754.9, 751.0, 753.8 ms at -O1), and each package's wrapper g++ run takes
    ~1.2 s less (4.6-5.0 s at -O1); a cold first step with the root's pieces, 6 packages,
    40.6 s -> 37.6 s. On CUDA the wrapper launches every kernel: AOTInductor's default stays."""
    if device == "cpu":
        return {**INDUCTOR_CONFIGS, "aot_inductor.compile_wrapper_opt_level": "O0"}
    return dict(INDUCTOR_CONFIGS)

DTYPES = {"float32": torch.float32, "int64": torch.int64}
# train.precision -> the autocast dtype of the exported forward and loss (None: no autocast).
AUTOCAST = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
# What each twin takes: (inputs dtype, inputs rank, targets dtype, targets rank).
SIGNATURES = {"mlp": ("float32", 2, "int64", 1), "gpt": ("int64", 2, "int64", 2)}
SIGNATURES["llama"] = SIGNATURES["gpt"]  # token ids [B, T] -> logits [B, T, V]
SIGNATURES["exported"] = SIGNATURES["gpt"]  # kiln_py.exported_twin


class SpecError(ValueError):
    """The spec is malformed or names something this package cannot build (exit 2)."""


# ---- the spec -----------------------------------------------------------------------------------

def read_spec(path):
    try:
        with open(path) as f:
            spec = json.load(f)
    except OSError as e:
        raise SpecError(f"cannot read the spec {path}: {e.strerror}; pass the file kiln wrote")
    except json.JSONDecodeError as e:
        raise SpecError(f"{path} is not JSON ({e}); kiln writes it, rebuild or report the bug")
    if not isinstance(spec, dict):
        raise SpecError(f"{path}: the spec must be a JSON object")
    unit = isinstance(spec.get("graph"), str) and spec["graph"] == "unit"
    for key in ("model", "graph", "device", "package") + (() if unit else ("inputs", "targets")):
        if key not in spec:
            raise SpecError(f"{path}: missing key '{key}'")
    if not isinstance(spec["model"], dict) or "name" not in spec["model"]:
        raise SpecError(f"{path}: 'model' must be an object with a 'name'")
    if spec["graph"] not in ("train", "eval", "unit"):
        raise SpecError(f"{path}: graph = {spec['graph']!r}; use \"train\", \"eval\" or \"unit\"")
    if spec["device"] not in ("cpu", "cuda"):
        raise SpecError(f"{path}: device = {spec['device']!r}; use \"cpu\" or \"cuda\"")
    if spec.get("precision", "fp32") not in AUTOCAST:
        raise SpecError(f"{path}: precision = {spec['precision']!r}; use one of "
                        f"{', '.join(AUTOCAST)}")
    if not os.path.isabs(spec["package"]):
        raise SpecError(f"{path}: package = {spec['package']!r} must be an absolute path")
    name = spec["model"]["name"]
    if unit:  # one unit's forward and backward (kiln_py.compile_units)
        try:
            compile_units.check_unit_spec(spec, path)
        except compile_units.UnitSpecError as e:
            raise SpecError(str(e))
        return spec
    if name in SIGNATURES:
        in_dtype, in_rank, tg_dtype, tg_rank = SIGNATURES[name]
        for tensor, dtype, rank in (("inputs", in_dtype, in_rank), ("targets", tg_dtype, tg_rank)):
            t = spec[tensor]
            shape = t.get("shape") if isinstance(t, dict) else None
            if (not isinstance(shape, list) or len(shape) != rank
                    or not all(isinstance(s, int) and s > 0 for s in shape)):
                raise SpecError(f"{path}: {tensor}.shape = {shape!r}; model '{name}' takes "
                                f"{rank} positive sizes")
            if t.get("dtype") != dtype:
                raise SpecError(f"{path}: {tensor}.dtype = {t.get('dtype')!r}; model '{name}' "
                                f"takes {dtype}")
    for i, d in enumerate(spec.get("dynamic", [])):
        if not isinstance(d, dict) or not all(k in d for k in ("tensor", "dim", "name", "min", "max")):
            raise SpecError(f"{path}: dynamic[{i}] needs tensor, dim, name, min and max")
        if d["tensor"] not in ("inputs", "targets"):
            raise SpecError(f"{path}: dynamic[{i}].tensor = {d['tensor']!r}; use inputs or targets")
        rank = len(spec[d["tensor"]]["shape"])
        if not isinstance(d["dim"], int) or not 0 <= d["dim"] < rank:
            raise SpecError(f"{path}: dynamic[{i}].dim = {d['dim']!r} is outside 0..{rank - 1}")
        if not (isinstance(d["min"], int) and isinstance(d["max"], int) and 0 < d["min"] <= d["max"]):
            raise SpecError(f"{path}: dynamic[{i}]: need 0 < min <= max, got {d['min']}..{d['max']}")
        if d["max"] < 2:
            raise SpecError(f"{path}: dynamic[{i}] '{d['name']}' has max {d['max']} < 2; "
                            f"make that dimension static")
        example = spec[d["tensor"]]["shape"][d["dim"]]
        if not max(2, d["min"]) <= example <= d["max"]:
            raise SpecError(f"{path}: dynamic[{i}] '{d['name']}': the example size {example} "
                            f"is outside {max(2, d['min'])}..{d['max']}")
    return spec


def scales_loss(spec):
    """The train graph takes the loss scaler's scale as a third input (fp16-mixed)."""
    return spec["graph"] == "train" and spec.get("precision", "fp32") == "fp16-mixed"


def example_inputs(spec, device):
    """Random example tensors of the spec's shapes; integer ones in range (vocabulary or classes);
    under fp16-mixed's train graph also a loss scale (torch.amp.GradScaler's initial 2**16)."""
    m = spec["model"]
    high = m.get("vocab_size", m.get("num_classes"))  # token models: the vocabulary
    out = []
    for tensor in ("inputs", "targets"):
        shape, dtype = spec[tensor]["shape"], DTYPES[spec[tensor]["dtype"]]
        if dtype.is_floating_point:
            out.append(torch.randn(shape, dtype=dtype, device=device))
        else:
            out.append(torch.randint(0, int(high), shape, dtype=dtype, device=device))
    if scales_loss(spec):
        out.append(torch.full([1], 65536.0, dtype=torch.float32, device=device))
    return tuple(out)


def dynamic_shapes(spec, notes):
    """torch.export dynamic_shapes for (inputs, targets): one Dim per name, shared across tensors.

    torch.export specialises sizes 0 and 1, so a range starting below 2 is raised to start at 2
    (noted in the result; kiln checks the accepted ranges before it calls the package)."""
    dims, shapes = {}, {"inputs": {}, "targets": {}}
    for d in spec.get("dynamic", []):
        lo = d["min"]
        if lo < 2:
            notes.append(f"{d['tensor']} dim {d['dim']} ('{d['name']}'): min {lo} raised to 2 "
                         f"(torch.export specialises sizes 0 and 1)")
            lo = 2
        if d["name"] not in dims:
            dims[d["name"]] = torch.export.Dim(d["name"], min=lo, max=d["max"])
        shapes[d["tensor"]][d["dim"]] = dims[d["name"]]
    if not dims:
        return None
    out = tuple(shapes[t] or None for t in ("inputs", "targets"))
    return out + (None,) if scales_loss(spec) else out


# ---- graph breaks -------------------------------------------------------------------------------

class _GraphBreakLog(logging.Handler):
    """Collects dynamo's graph-break log records: they carry the readable reason (type and
    explanation) that torch._dynamo.explain's break_reasons leave out."""

    LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
    WHERE = re.compile(r"in user code at (.+):(\d+)")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.reasons = {}  # (file, line) -> reason

    def emit(self, record):
        try:
            text = record.getMessage()
        except Exception:  # a record we cannot format is not worth failing the compile for
            return
        where = self.WHERE.search(text.split("\n", 1)[0])
        if not where:
            return
        lines = text.split("\n")
        reason = None
        for i, line in enumerate(lines):
            if line.strip().startswith("Explanation:") and i > 0:
                explanation = [line.strip()[len("Explanation:"):].strip()]
                for more in lines[i + 1:]:
                    if not more.strip():
                        break
                    explanation.append(more.strip())
                reason = f"{lines[i - 1].strip()}: {' '.join(explanation)}"
                break
        if reason is None:
            reason = next((l.split(":", 1)[1].strip() for l in lines
                           if l.startswith("Graph Break Reason:")), None)
        if reason:
            self.reasons.setdefault((where.group(1), int(where.group(2))), reason)

    def __enter__(self):
        self.logger = logging.getLogger(self.LOGGER)
        self.saved = (self.logger.level, self.logger.propagate, self.logger.disabled)
        self.logger.addHandler(self)
        self.logger.setLevel(logging.DEBUG)
        self.logger.propagate = False  # collect, do not print
        self.logger.disabled = False
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.level, self.logger.propagate, self.logger.disabled = self.saved


def explain(module, args):
    """(graph_count, graph breaks): every break once, {"reason", "where", "dynamo"}, in order.

    A break inside a nested call also splits each caller, so graph_count can exceed the number of
    distinct breaks + 1; the breaks are counted by place (file, line, reason)."""
    with _GraphBreakLog() as log:
        torch._dynamo.reset()
        out = torch._dynamo.explain(module)(*args)
        torch._dynamo.reset()
    breaks, seen = [], set()
    for r in out.break_reasons:
        frame = r.user_stack[-1] if r.user_stack else None
        key = (frame.filename, frame.lineno) if frame else ("?", 0)
        if (key, r.reason) in seen:
            continue
        seen.add((key, r.reason))
        where = f"{os.path.basename(key[0])}:{key[1]} in {frame.name}" if frame else "unknown"
        breaks.append({"reason": log.reasons.get(key, r.reason), "where": where,
                       "dynamo": r.reason})
    return out.graph_count, breaks


def found_graph_breaks(module, args, result, where="", advice=""):
    """Runs explain(module, args) into result (graph_count, graph_breaks, graph_break_count and
    seconds["explain"]). With breaks: status "graph_breaks", an error listing them ("N graph
    break(s)<where>, nothing compiled: ...<advice>"), and True (the caller compiles nothing)."""
    begin = time.perf_counter()
    result["graph_count"], result["graph_breaks"] = explain(module, args)
    result["graph_break_count"] = len(result["graph_breaks"])
    result["seconds"]["explain"] = time.perf_counter() - begin
    if not result["graph_breaks"]:
        return False
    result["status"] = "graph_breaks"
    listed = "; ".join(f"{b['where']}: {b['reason'].split(':')[0]}"
                       for b in result["graph_breaks"])
    result["error"] = (f"{len(result['graph_breaks'])} graph break(s){where}, nothing compiled: "
                       f"{listed}{advice}")
    return True


# ---- export, joint graph, compile ---------------------------------------------------------------

def joint_graph(ep, notes):
    """The joint forward+backward program of a loss-returning export: outputs the loss, then the
    gradient of every parameter.

    torch.export.experimental._export_forward_backward decomposes with core_aten_decompositions,
    which on CPU turns the flash-attention forward into math ops while the backward stays the
    fused kernel that expects the fused forward's logsumexp: wrong gradients upstream of
    scaled_dot_product_attention. So this does what it does internally with every
    scaled_dot_product decomposition left out (tests/python pins the gradients against autograd),
    and falls back to the stock function only if those private names are gone."""
    try:
        from torch._decomp import core_aten_decompositions
        from torch.export.experimental import (_copy_graph_module_and_signature,
                                               _remove_detach_pass)
        from torch.export.exported_program import _decompose_exported_program
    except ImportError as e:
        from torch.export.experimental import _export_forward_backward
        notes.append(f"joint graph: stock _export_forward_backward used ({e}); its gradients "
                     f"upstream of scaled_dot_product_attention may be wrong on CPU")
        return _export_forward_backward(ep, joint_loss_index=0)
    table = {op: fn for op, fn in core_aten_decompositions().items()
             if "scaled_dot_product" not in str(op)}
    ep = _decompose_exported_program(ep, cia_to_decomp={}, python_decomp_table=table,
                                     joint_loss_index=0, decompose_custom_triton_ops=False)
    gm, signature = _copy_graph_module_and_signature(ep)
    _remove_detach_pass(gm, signature)
    return ep._update(gm, signature)


def autocast(device, precision):
    """torch.autocast for the spec's precision on its device (a no-op context under fp32)."""
    dtype = AUTOCAST[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=dtype)


class TrainLoss(models.WithLoss):
    """The "train" graph's module: forward(inputs, targets) -> the loss, under the precision's
    autocast (as kiln's eager forward and loss run). Same parameter names as WithLoss."""

    def __init__(self, model, device, precision):
        super().__init__(model)
        self.device_type, self.precision = device, precision

    def forward(self, inputs, targets):
        with autocast(self.device_type, self.precision):
            return models.loss(self._kiln_twin(inputs), targets)


class ScaledTrainLoss(TrainLoss):
    """fp16-mixed's "train" graph: forward(inputs, targets, loss_scale) -> loss x loss_scale (a
    scalar), the value kiln's eager step calls backward on; the joint graph's gradients are those
    of it, unscaled by kiln afterwards."""

    def forward(self, inputs, targets, loss_scale):
        return super().forward(inputs, targets) * loss_scale.squeeze(0)


class EvalOutputs(TrainLoss):
    """The "eval" graph's module: forward(inputs, targets) -> the loss, and for a classifier
    ([B, C] logits) also the number of samples whose argmax is the target (an int64 scalar), as
    kiln's Trainer::evaluate counts them, under the precision's autocast. Same parameter names as
    WithLoss."""

    def forward(self, inputs, targets):
        with autocast(self.device_type, self.precision):
            logits = self._kiln_twin(inputs)
            loss = models.loss(logits, targets)
        if logits.dim() == 2:
            return loss, logits.argmax(1).eq(targets).sum()
        return loss


def export(module, args, spec, notes):
    """The exported program of the spec's graph: "train" the joint graph, "eval" the forward loss."""
    shapes = dynamic_shapes(spec, notes)
    if spec["graph"] == "eval":
        with torch.no_grad():
            return torch.export.export(module, args, dynamic_shapes=shapes), None
    ep = torch.export.export(module, args, dynamic_shapes=shapes)
    return ep, lambda: joint_graph(ep, notes)


def outputs_of(ep):
    """(parameters, outputs): the parameter of each gradient output in order, and every output's
    name ("loss", "grad:<parameter>"; an eval graph: "loss", then "correct" for a classifier)."""
    from torch.export.graph_signature import OutputKind
    parameters, outputs = [], []
    user_names = ["loss", "correct"]
    for s in ep.graph_signature.output_specs:
        if s.kind in (OutputKind.LOSS_OUTPUT, OutputKind.USER_OUTPUT):
            users = sum(1 for o in outputs if not o.startswith("grad:"))
            if users >= len(user_names):
                raise RuntimeError(f"unexpected output {users + 1} ({s.arg}) in the exported graph")
            outputs.append(user_names[users])
        elif s.kind == OutputKind.GRADIENT_TO_PARAMETER:
            parameters.append(s.target)
            outputs.append(f"grad:{s.target}")
        else:
            raise RuntimeError(f"unexpected output {s.kind} ({s.target}) in the exported graph")
    return parameters, outputs


def accepted_shapes(ep, spec):
    """The exact shapes the package accepts, per user input: dtype and a shape whose entries are a
    size or {"name", "min", "max"} for a dynamic one (ranges as export resolved them). AOTInductor
    does not check the shape of a call: kiln must, before it calls."""
    from torch.export.graph_signature import InputKind
    user = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    names = {}
    for d in spec.get("dynamic", []):
        names.setdefault((d["tensor"], d["dim"]), d["name"])
    out = {}
    for tensor, arg in zip(("inputs", "targets"), user):
        val = placeholders[arg].meta["val"]
        shape = []
        for dim, size in enumerate(val.shape):
            if isinstance(size, int):
                shape.append(size)
                continue
            expr = size.node.expr
            vr = ep.range_constraints.get(expr)
            if vr is None:
                raise RuntimeError(f"{tensor} dim {dim} is {expr}, not a plain symbol; "
                                   f"this compile step supports one symbol per dimension")
            shape.append({"name": names.get((tensor, dim), str(expr)), "min": int(vr.lower),
                          "max": int(vr.upper)})
        out[tensor] = {"dtype": spec[tensor]["dtype"], "shape": shape}
    return out


def compile_package(ep, path, device):
    return aoti.compile_and_package(ep, path, inductor_configs(device))


def package_constants(path, device):
    """The constant FQNs of the built package (the names kiln must bind)."""
    from torch._inductor import aoti_load_package
    loader = aoti_load_package(path, device_index=0 if device == "cuda" else -1)
    return list(loader.get_constant_fqns())


# ---- main ---------------------------------------------------------------------------------------

def torch_identity():
    return {"version": torch.__version__, "git": getattr(torch.version, "git_version", "")}


def run(spec, result):
    """Fills result; returns the exit status."""
    if spec.get("threads", 0) and int(spec["threads"]) > 0:
        torch.set_num_threads(int(spec["threads"]))
    if spec.get("deterministic", False):
        # run.deterministic: Inductor then lowers scatter-adds (the embedding backward's
        # index_put with accumulate) to ATen's deterministic fallback instead of parallel atomic
        # adds, whose order varies from run to run, and skips numerics-changing benchmarking.
        torch.use_deterministic_algorithms(True)
        import torch._inductor.config as inductor_config
        inductor_config.deterministic = True
    if spec["device"] == "cuda" and not torch.cuda.is_available():
        raise SpecError(f"device cuda asked, but this torch ({torch.__version__}) sees no CUDA "
                        f"device; compile on the machine that trains, with a CUDA torch")
    if spec["device"] == "cpu" and spec.get("isa_probe", True) is not False:
        # Inductor's ISA checks in a child while this process builds the twin and exports
        # (kiln_py.aoti, "beside export"); main() waits for it. kiln asks one of several
        # compiler processes it starts at once for the child ("isa_probe": false the others).
        result["_isa_probe"] = aoti.start_cpu_isa_probe()
    try:
        model = models.build(spec["model"])
    except ValueError as e:
        raise SpecError(str(e))
    device = torch.device(spec["device"])
    precision = spec.get("precision", "fp32")
    if spec["graph"] == "unit":
        result["precision"] = precision
        try:
            return compile_units.run_unit(spec, result, model, device,
                                          lambda: autocast(spec["device"], precision),
                                          inductor_configs(spec["device"]), found_graph_breaks)
        except compile_units.UnitSpecError as e:
            raise SpecError(str(e))
    if spec["graph"] == "eval":
        kind = EvalOutputs
    else:
        kind = ScaledTrainLoss if scales_loss(spec) else TrainLoss
    module = kind(model, spec["device"], precision).to(device)
    if spec["graph"] == "train":
        module.train()
    else:
        module.eval()
    args = example_inputs(spec, device)
    seconds, notes = result["seconds"], result["notes"]

    if found_graph_breaks(module, args, result, advice="; remove them from the model or run eager"):
        return EXIT_GRAPH_BREAKS

    begin = time.perf_counter()
    ep, make_joint = export(module, args, spec, notes)
    seconds["export"] = time.perf_counter() - begin
    if make_joint is not None:
        begin = time.perf_counter()
        ep = make_joint()
        seconds["joint"] = time.perf_counter() - begin
    result["parameters"], result["outputs"] = outputs_of(ep)
    result["precision"] = precision
    result["inputs"] = ["inputs", "targets"] + (["loss_scale"] if scales_loss(spec) else [])
    result["accepts"] = accepted_shapes(ep, spec)

    begin = time.perf_counter()
    path = compile_package(ep, spec["package"], spec["device"])
    seconds["compile"] = time.perf_counter() - begin
    result["package"] = path
    begin = time.perf_counter()
    result["constants"] = package_constants(path, spec["device"])
    seconds["constants"] = time.perf_counter() - begin
    result["status"] = "ok"
    return EXIT_OK


def inductor_seconds():
    """Where the compile's seconds went inside torch, from torch's own phase timers
    (torch._dynamo.utils.compilation_time_metrics, each `dynamo_timed` region summed over its
    calls; nested regions are inside their parents: "compile_file" is the C++ compile and link,
    "GraphLowering.run" the lowering, "Scheduler.codegen" the kernels' code generation). Regions
    under a millisecond are left out."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without the timers: nothing to say
        return {}
    totals = {key: sum(values) for key, values in compilation_time_metrics.items()}
    return {key: round(total, 4) for key, total in sorted(totals.items()) if total >= 1e-3}


def write_result(path, result):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def main(argv=None):
    # torch.export's own use of a deprecated pytree API, printed on every export: noise in kiln's log.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help="the compile spec kiln wrote (JSON)")
    parser.add_argument("--result", required=True, help="write the result here (JSON)")
    args = parser.parse_args(argv)
    result = {"status": "error", "error": "", "graph_count": 0, "graph_break_count": 0,
              "graph_breaks": [], "parameters": [], "outputs": [], "constants": [],
              "accepts": {}, "notes": [], "seconds": {}, "torch": torch_identity()}
    try:
        code = run(read_spec(args.spec), result)
    except SpecError as e:
        result["error"] = str(e)
        print(f"kiln_py.compile: {e}", file=sys.stderr)
        code = EXIT_BAD_SPEC
    except Exception as e:  # export, joint graph or AOTInductor failed: say which, with the cause
        cause = " ".join(f"{type(e).__name__}: {e}".split())
        if len(cause) > 600:
            cause = cause[:600] + "..."
        result["error"] = (f"{cause} (the model's Python twin could not be compiled; see the "
                           f"traceback on stderr, run eager, or report it with the spec)")
        traceback.print_exc()
        code = EXIT_FAILED
    probe = result.pop("_isa_probe", None)
    result["isa_probe"] = ("none" if probe is None else
                           "ok" if aoti.wait_cpu_isa_probe(probe) == 0 else "failed")
    result["seconds"]["import_torch"] = IMPORT_TORCH_SECONDS
    result["inductor_seconds"] = inductor_seconds()
    result["cpp_builds"] = aoti.CPP_BUILDS
    write_result(args.result, result)
    return code


if __name__ == "__main__":
    sys.exit(main())
