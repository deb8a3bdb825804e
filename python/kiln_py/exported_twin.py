"""The Python twin of an exported model (model.name = "exported"): the package's own graph,
deserialized from its data-only files (forward.json, weights.safetensors; no pickle) and unlifted
into a module whose parameters and buffers carry the package's state_dict names, as kiln's C++
ExportedModel registers them. The compile step (kiln_py.compile) exports and compiles it as it does
kiln's own twins; the graph is the one kiln runs eagerly, so the two compute the same function.
"""
import json
import os

import torch

from kiln_py.export_model import sha256_file


def build(spec):
    """The module for kiln's describe() of an exported model: {"package": DIR, "graph_sha256",
    "weights_sha256", ...}. Raises ValueError when the package is missing or its files are not
    the ones kiln loaded (their SHA-256)."""
    from safetensors.torch import load_file
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _bytes_to_dataclass

    package = spec.get("package")
    if not package or not os.path.isfile(os.path.join(package, "package.json")):
        raise ValueError(f"model 'exported': package {package!r} holds no package.json")
    with open(os.path.join(package, "package.json")) as f:
        manifest = json.load(f)
    graph = os.path.join(package, manifest["graphs"][0]["file"])
    weights = os.path.join(package, manifest["weights"]["file"])
    for path, key in ((graph, "graph_sha256"), (weights, "weights_sha256")):
        if spec.get(key) and sha256_file(path) != spec[key]:
            raise ValueError(f"model 'exported': {path} is not the file kiln loaded (its SHA-256 "
                             "differs); re-run with the package as it is now")
    with open(graph, "rb") as f:
        program = _bytes_to_dataclass(schema.ExportedProgram, f.read())
    tensors = load_file(weights)
    state, constants = {}, {}
    for entry in program.graph_module.signature.input_specs:
        value = entry.value
        if entry.type == "parameter":
            state[value.parameter_name] = torch.nn.Parameter(tensors[value.parameter_name])
        elif entry.type == "buffer":
            (state if value.persistent else constants)[value.buffer_name] = \
                tensors[value.buffer_name]
        elif entry.type == "tensor_constant":
            constants[value.tensor_constant_name] = tensors[value.tensor_constant_name]
    ep = ExportedProgramDeserializer().deserialize(program, state, constants, None)
    if any(s.kind.name == "BUFFER_MUTATION" for s in ep.graph_signature.output_specs):
        raise ValueError("model 'exported': the package's graph writes buffers, which a compiled "
                         "step binds read-only; set compile.backend = \"eager\"")
    return ep.module()
