"""`kiln model import`: a PyTorch model exported once, before training, into a data-only package
that kiln's C++ graph runner trains (src/models/exported.cpp). Never in the step loop.

Run by kiln (src/models/exported.cpp import_model) as a child process:

    python -c <runner> <dir holding kiln_py> --spec spec.json --result result.json

The spec names the source: {"module": "path/to/model.py:build", "options": {...}} (the factory is
called with the options as keyword arguments and returns a torch.nn.Module whose forward takes
token ids [B, T] int64 and returns logits [B, T, V]) or {"hf": DIR} (a Hugging Face directory:
config.json + safetensors, any AutoModelForCausalLM; its forward(input_ids).logits is exported).
"weights" (optional) is a safetensors file whose tensors replace the module's by state_dict name
(every parameter must be there, with its shape).

The package, all in "out":
  forward.json          the serialized ExportedProgram (torch/_export/serde/schema.py's JSON) after
                        run_decompositions({}): plain ATen operators, batch and sequence symbolic
  weights.safetensors   the initial parameters, buffers and lifted constants, by state_dict name
  package.json          the manifest: versions, source and its hash, input, dynamic ranges, the
                        unit list (find_units; kiln checks it splits the graph), each
                        file's SHA-256 (kiln refuses a package whose files do not match)

The ExportedProgram's other parts (its pickled state_dict, constants and sample inputs) are not
kept: the package holds data only. Writes are staged in a hidden directory beside "out" and
renamed into place at the end, so a failed import leaves "out" as it was.

The result is one JSON object whose "status" is "written" or "error" (with a one-line "message").
"""

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback

PACKAGE_FORMAT = "kiln-exported-model"
PACKAGE_VERSION = 1


class ImportError_(Exception):
    """A problem the user can fix: reported as one line."""


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_factory(spec):
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ImportError_(f"--module {spec!r}: expected path/to/file.py:factory")
    if not os.path.isfile(path):
        raise ImportError_(f"--module {spec!r}: {path} is not a file")
    module_spec = importlib.util.spec_from_file_location("kiln_user_model", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ImportError_(f"--module {spec!r}: {path} defines no callable {name!r}")
    return factory, path


def build_source(spec, torch):
    """(module, source manifest, max sequence length or None)."""
    if spec.get("module"):
        factory, path = load_factory(spec["module"])
        options = spec.get("options") or {}
        module = factory(**options)
        if not isinstance(module, torch.nn.Module):
            raise ImportError_(f"--module {spec['module']!r}: the factory returned "
                               f"{type(module).__name__}, not a torch.nn.Module")
        source = {"kind": "module", "module": spec["module"], "options": options,
                  "path": os.path.abspath(path), "sha256": sha256_file(path)}
        return module, source, None
    hf = spec["hf"]
    if not os.path.isfile(os.path.join(hf, "config.json")):
        raise ImportError_(f"--hf {hf}: no config.json there (a save_pretrained directory)")
    import transformers
    config = transformers.AutoConfig.from_pretrained(hf)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            hf, torch_dtype=torch.float32, attn_implementation="sdpa")
    except ValueError as e:
        raise ImportError_(f"--hf {hf}: transformers cannot build it as a causal LM: "
                           f"{str(e).splitlines()[0]}") from None
    model.config.use_cache = False

    class Logits(torch.nn.Module):
        # Holds the model as its only child under its own attribute names, so the state_dict
        # names are the model's ("model.embed_tokens.weight", "lm_head.weight").
        def __init__(self, inner):
            super().__init__()
            for name, child in inner.named_children():
                self.add_module(name, child)
            object.__setattr__(self, "_inner", inner)

        def forward(self, input_ids):
            return self._inner(input_ids=input_ids, use_cache=False).logits

    files = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))
    source = {"kind": "hf", "path": os.path.abspath(hf), "model_type": config.model_type,
              "architectures": list(config.architectures or []),
              "config_sha256": sha256_file(os.path.join(hf, "config.json")),
              "files": [{"name": f, "sha256": sha256_file(os.path.join(hf, f))} for f in files]}
    return Logits(model), source, getattr(config, "max_position_embeddings", None)


def source_module(package):
    """The original PyTorch module a package was imported from, rebuilt from its manifest (the
    peer that trains it eagerly in Python to check kiln's C++ run of the exported graph). Its
    state_dict names are the package's; the caller loads the weights it wants."""
    import torch
    with open(os.path.join(package, "package.json")) as f:
        source = json.load(f)["source"]
    if source["kind"] == "hf":
        spec = {"hf": source["path"]}
    else:
        factory = source["module"].rpartition(":")[2]
        spec = {"module": f"{source['path']}:{factory}", "options": source.get("options") or {}}
    return build_source(spec, torch)[0].float()


def load_weights(module, path, torch):
    from safetensors.torch import load_file
    tensors = load_file(path)
    own = dict(module.named_parameters())
    own.update(dict(module.named_buffers()))
    for name, p in own.items():
        if name not in tensors:
            raise ImportError_(f"--weights {path}: no tensor {name!r} (the module's parameter)")
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise ImportError_(f"--weights {path}: {name!r} is {list(tensors[name].shape)}, the "
                               f"module's is {list(p.shape)}")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(tensors[name])


def find_units(module, requested, torch):
    """The unit list: {"prefix": the nn.ModuleList's path, "count": its length}, or None. kiln
    splits the graph at these modules (each node's nn_module_stack) so activation checkpointing
    and FSDP wrap each one. `requested`: "" finds the ModuleList holding the most parameters,
    "none" keeps the model whole, anything else names the list."""
    if requested == "none":
        return None
    if requested:
        try:
            found = module.get_submodule(requested)
        except AttributeError:
            raise ImportError_(f"--units {requested!r}: the model has no module by that path") \
                from None
        if not isinstance(found, (torch.nn.ModuleList, torch.nn.Sequential)) or len(found) == 0:
            raise ImportError_(f"--units {requested!r} is a {type(found).__name__}, not a "
                               "non-empty nn.ModuleList (the list of blocks each unit is)")
        return {"prefix": requested, "count": len(found)}
    best, best_parameters = None, 0
    for path, child in module.named_modules():
        if not path or not isinstance(child, torch.nn.ModuleList) or len(child) == 0:
            continue
        parameters = sum(p.numel() for p in child.parameters())
        if parameters > best_parameters:
            best, best_parameters = {"prefix": path, "count": len(child)}, parameters
    return best


def export(spec):
    import torch
    from torch._export.serde.serialize import serialize
    started = time.time()
    module, source, hf_max_seq = build_source(spec, torch)
    module = module.float().eval()
    if spec.get("weights"):
        load_weights(module, spec["weights"], torch)
    units = find_units(module, spec.get("units") or "", torch)
    max_seq = int(spec.get("max_seq") or hf_max_seq or 0)
    if max_seq < 2:
        raise ImportError_("--max-seq: give the longest sequence the model takes (>= 2)")
    max_batch = int(spec.get("max_batch") or 4096)
    example_seq = min(max_seq, 16)
    # The probe runs the forward once: a forward that writes its buffers (a step counter, running
    # statistics) must not change the package's initial state, so they are put back after it.
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    with torch.no_grad():
        probe = module(torch.zeros(2, example_seq, dtype=torch.int64))
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
    if not isinstance(probe, torch.Tensor) or probe.dim() != 3:
        raise ImportError_("the model's forward must return logits [B, T, V] as one tensor; it "
                           f"returned {type(probe).__name__}"
                           + (f" of shape {list(probe.shape)}" if hasattr(probe, "shape") else ""))
    vocab = int(probe.shape[-1])
    gen = torch.Generator().manual_seed(0)
    example = torch.randint(0, vocab, (2, example_seq), generator=gen)
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    seq = torch.export.Dim("seq", min=2, max=max_seq)
    try:
        ep = torch.export.export(module, (example,), dynamic_shapes=({0: batch, 1: seq},),
                                 strict=False)
        ep = ep.run_decompositions({})
    except Exception as e:  # torch.export's own message names the construct it cannot trace
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ImportError_(f"torch.export cannot export the model: {first}") from None
    artifact = serialize(ep)
    program = json.loads(artifact.exported_program)
    signature = program["graph_module"]["signature"]
    tensors = {}
    state = ep.state_dict
    for entry in signature["input_specs"]:
        kind, body = next(iter(entry.items()))
        if kind == "parameter":
            tensors[body["parameter_name"]] = state[body["parameter_name"]]
        elif kind == "buffer":
            name = body["buffer_name"]
            tensors[name] = state[name] if name in state else ep.constants[name]
        elif kind == "tensor_constant":
            tensors[body["tensor_constant_name"]] = ep.constants[body["tensor_constant_name"]]
        elif kind != "user_input":
            raise ImportError_(f"the exported graph takes a {kind} input, which kiln cannot "
                               "supply (custom objects and effect tokens are not supported)")
    out = os.path.abspath(spec["out"])
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".kiln-import-{os.path.basename(out)}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        with open(os.path.join(staging, "forward.json"), "wb") as f:
            f.write(artifact.exported_program)
        from safetensors.torch import save_file
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
                  os.path.join(staging, "weights.safetensors"))
        ops = sorted({n["target"] for n in program["graph_module"]["graph"]["nodes"]})
        versions = {"torch": torch.__version__}
        if source["kind"] == "hf":
            import transformers
            versions["transformers"] = transformers.__version__
        manifest = {
            "format": PACKAGE_FORMAT, "format_version": PACKAGE_VERSION,
            "versions": versions, "kiln_version": spec.get("kiln_version", ""),
            "serde_schema": program["schema_version"], "source": source,
            "input": {"kind": "tokens", "dtype": "int64", "vocab_size": vocab,
                      "dims": {"batch": [1, max_batch], "seq": [2, max_seq]}},
            "output": "logits",
            "units": units,
            "graphs": [{"name": "forward", "file": "forward.json",
                        "sha256": sha256_file(os.path.join(staging, "forward.json")),
                        "nodes": len(program["graph_module"]["graph"]["nodes"]), "ops": ops}],
            "weights": {"file": "weights.safetensors", "tensors": len(tensors),
                        "sha256": sha256_file(os.path.join(staging, "weights.safetensors"))},
            "export_seconds": round(time.time() - started, 3),
        }
        with open(os.path.join(staging, "package.json"), "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        if os.path.exists(out):
            if not os.path.isdir(out) or (os.listdir(out) and not os.path.isfile(
                    os.path.join(out, "package.json"))):
                raise ImportError_(f"--out {out} exists and is not a kiln model package; choose "
                                   "an empty or new directory")
            old = out + f".old-{os.getpid()}"
            os.rename(out, old)
            os.rename(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()

    def write(result):
        with open(args.result + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(args.result + ".tmp", args.result)

    try:
        with open(args.spec) as f:
            spec = json.load(f)
        manifest = export(spec)
        write({"status": "written", "manifest": manifest})
    except ImportError_ as e:
        write({"status": "error", "message": str(e)})
    except Exception as e:  # a bug or an unexpected library failure: kiln prints the traceback
        write({"status": "failed", "message": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()})


if __name__ == "__main__":
    main()
