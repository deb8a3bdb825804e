"""Oracle for kiln's optimizers: replays the same parameters and gradients through torch.optim.

Usage: optimizer_oracle.py CASE.safetensors...
Each file (written by tests/train/optimizer_test.cpp) holds the initial parameters "init/<p>", the
gradients "grad/<step>/<p>" (absent: that parameter has no gradient on that step, as a parameter
unused by a forward pass), and kiln's final parameters "kiln/<p>" and step counts
"kiln_step/<p>". Its metadata: "optimizer" (adamw | sgd), "lr", "weight_decay", "momentum",
"nesterov", "steps". Weight decay applies to parameters with >= 2 dims, as in kiln. Exits 1 with
one line per disagreement when any case disagrees (all cases in one process: one torch import).
"""
import sys

import torch
from safetensors import safe_open


def main(path):
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    names = sorted(k[len("init/"):] for k in tensors if k.startswith("init/"))
    params = {n: torch.nn.Parameter(tensors["init/" + n].clone()) for n in names}
    decay = [params[n] for n in names if params[n].dim() >= 2]
    no_decay = [params[n] for n in names if params[n].dim() < 2]
    lr, wd = float(meta["lr"]), float(meta["weight_decay"])
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    if meta["optimizer"] == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, foreach=False)
    else:
        opt = torch.optim.SGD(groups, lr=lr, momentum=float(meta["momentum"]),
                              nesterov=meta["nesterov"] == "true", foreach=False)
    steps = int(meta["steps"])
    for step in range(steps):
        for n in names:
            key = f"grad/{step}/{n}"
            params[n].grad = tensors[key].clone() if key in tensors else None
        opt.step()
    problems = []
    for n in names:
        mine, theirs = params[n].detach(), tensors["kiln/" + n]
        if not torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6):
            problems.append(f"{n}: max difference {(mine - theirs).abs().max().item():.3g}")
        state = opt.state.get(params[n], {})
        count = float(state["step"]) if "step" in state else 0.0
        if meta["optimizer"] == "adamw" and count != tensors["kiln_step/" + n].item():
            problems.append(f"{n}: torch.optim step {count}, kiln {tensors['kiln_step/' + n].item()}")
    for p in problems:
        print(p)
    print(f"{meta['optimizer']} fused={meta['fused']}: {len(names)} parameters, {steps} steps, "
          f"{len(problems)} disagreement(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(max(main(path) for path in sys.argv[1:]) if len(sys.argv) > 1 else 2)
