"""Python twins of kiln's C++ models, with the same parameter names (kiln/HF names).

Written from the architecture description (docs/architecture.md), not translated from kiln's C++;
the initialisation is not kiln's (kiln binds or loads its own weights), the forward pass and the
loss are. The peer tests and tests/python check that a twin loaded with kiln's initial weights gives
kiln's loss and gradients.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Mlp(nn.Module):
    """input_dim -> hidden_dim -> ReLU -> num_classes; [B, D] float -> [B, C] logits.

    data_dependent_branch (a test model for graph breaks): ReLU when the batch sums to > 0, else
    tanh, a Python `if` on a tensor value, which dynamo cannot trace into one graph.
    """

    def __init__(self, input_dim, hidden_dim, num_classes, data_dependent_branch=False):
        super().__init__()
        self.data_dependent_branch = data_dependent_branch
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, num_classes)

    def forward(self, x):
        h = self.fc1(x)
        if not self.data_dependent_branch:
            return self.fc2(F.relu(h))
        if x.sum() > 0:  # the data-dependent branch: graph break here
            h = F.relu(h)
        else:
            h = torch.tanh(h)
        return self.fc2(h)


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Mlp4(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = Mlp4(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    """GPT-2, pre-LayerNorm, GELU(tanh), head tied to the token embedding; [B, T] int64 -> [B, T, V]."""

    PRESETS = {"tiny": (5, 4, 128, 256, 256), "small": (6, 6, 384, 256, 256),
               "gpt2-124m": (12, 12, 768, 1024, 50257)}

    def __init__(self, n_layer, n_head, n_embd, block_size, vocab_size):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd)))

    def forward(self, idx):
        t = self.transformer
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = t.wte(idx) + t.wpe(pos)
        for block in t.h:
            x = block(x)
        return F.linear(t.ln_f(x), t.wte.weight)  # head tied to the token embedding


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, normalised in float32."""

    def __init__(self, d, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(t, head_dim, theta, device):
    """cos, sin [T, head_dim] for positions 0..T-1; frequency i = theta^(-2i/head_dim), used for both
    halves of a head (the "rotate half" convention of Hugging Face's Llama)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device)
                                .float() / head_dim))
    angles = torch.arange(t, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary positions: n_head query heads share n_kv_head key/value
    heads (each serves n_head / n_kv_head consecutive query heads); no biases."""

    def __init__(self, d, heads, kv_heads, theta):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, d // heads, theta
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary(T, self.head_dim, self.theta, x.device)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d, heads, kv_heads, hidden, theta, eps):
        super().__init__()
        self.self_attn = LlamaAttention(d, heads, kv_heads, theta)
        self.mlp = SwiGLU(d, hidden)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """A Llama-style decoder, pre-RMSNorm, rotary positions, SwiGLU, grouped-query attention, no
    biases, the head optionally tied to the token embedding; [B, T] int64 -> [B, T, V]. Parameter
    names are Hugging Face LlamaForCausalLM's (model.embed_tokens.weight, model.layers.0.self_attn.
    q_proj.weight, ..., model.norm.weight, lm_head.weight)."""

    # n_layer, n_head, n_kv_head, n_embd, intermediate_size, block_size, vocab_size, rope_theta
    PRESETS = {"llama-tiny": (5, 4, 2, 128, 352, 256, 256, 10000.0),
               "llama-small": (12, 6, 2, 384, 1024, 512, 256, 10000.0),
               "llama3-8b": (32, 32, 8, 4096, 14336, 8192, 128256, 500000.0)}
    PRESETS["tiny"], PRESETS["small"] = PRESETS["llama-tiny"], PRESETS["llama-small"]

    def __init__(self, n_layer, n_head, n_kv_head, n_embd, intermediate_size, block_size,
                 vocab_size, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False):
        super().__init__()
        if n_embd % n_head or (n_embd // n_head) % 2 or n_head % n_kv_head:
            raise ValueError(f"n_embd {n_embd}, n_head {n_head}, n_kv_head {n_kv_head}: need an "
                             f"even head size and n_head a multiple of n_kv_head")
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(vocab_size, n_embd),
            layers=nn.ModuleList(LlamaDecoderLayer(n_embd, n_head, n_kv_head, intermediate_size,
                                                   rope_theta, norm_eps) for _ in range(n_layer)),
            norm=RMSNorm(n_embd, norm_eps)))
        self.lm_head = None if tie_embeddings else nn.Linear(n_embd, vocab_size, bias=False)

    # WithLoss holds a twin as its attribute `model`, which there shadows this twin's own `model`
    # child: parameter paths such as "model.embed_tokens.weight" (which torch.export walks with
    # getattr from the WithLoss) then pass through this twin, whose attributes lead on to them.
    embed_tokens = property(lambda self: self.model.embed_tokens)
    layers = property(lambda self: self.model.layers)
    norm = property(lambda self: self.model.norm)

    def forward(self, idx):
        m = self.model
        x = m.embed_tokens(idx)
        for layer in m.layers:
            x = layer(x)
        x = m.norm(x)
        return F.linear(x, m.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)


LLAMA_KEYS = ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "block_size",
              "vocab_size")


def loss(logits, targets):
    """Mean cross-entropy over every target (for gpt over the B*T positions), as kiln's Model::loss."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class WithLoss(nn.Module):
    """forward(inputs, targets) -> the model's loss, a scalar.

    The model's children and parameters are registered on this module under their own names, so
    its parameter FQNs are exactly the model's ("fc1.weight", "transformer.wte.weight"), not
    "model.fc1.weight": kiln binds its tensors to an exported package's constants by these names.
    The model itself is held without being registered; it shares every parameter with this module.
    """

    def __init__(self, model):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b)
        # Not a submodule (no prefix), and under a name no model's child takes: torch.export
        # resolves "model.embed_tokens.weight" through the registered children, which a held
        # attribute named "model" would shadow (a Hugging Face model's top child is "model").
        object.__setattr__(self, "_kiln_twin", model)

    def forward(self, inputs, targets):
        return loss(self._kiln_twin(inputs), targets)


def build(spec):
    """The twin for kiln's model JSON: {"name": "mlp" | "gpt", ...Model::describe()'s keys}.

    mlp: input_dim, hidden_dim, num_classes [, data_dependent_branch]; gpt: n_layer, n_head,
    n_embd, block_size, vocab_size (init_std, tied_head, activation and norm are kiln's fixed
    choices and are ignored); llama: n_layer, n_head, n_kv_head, n_embd, intermediate_size,
    block_size, vocab_size, rope_theta, norm_eps, tie_embeddings. Raises ValueError for an unknown
    name or a missing key.
    """
    name = spec.get("name")
    if name == "exported":  # a package `kiln model import` wrote: its own graph
        from kiln_py import exported_twin
        return exported_twin.build(spec)
    try:
        if name == "mlp":
            return Mlp(int(spec["input_dim"]), int(spec["hidden_dim"]), int(spec["num_classes"]),
                       bool(spec.get("data_dependent_branch", False)))
        if name == "gpt":
            return Gpt(*(int(spec[k]) for k in ("n_layer", "n_head", "n_embd", "block_size",
                                                "vocab_size")))
        if name == "llama":
            return Llama(*(int(spec[k]) for k in LLAMA_KEYS), rope_theta=float(spec["rope_theta"]),
                         norm_eps=float(spec["norm_eps"]),
                         tie_embeddings=bool(spec["tie_embeddings"]))
    except KeyError as e:
        raise ValueError(f"model '{name}' needs the key {e.args[0]!r} in the model JSON "
                         f"(as kiln's Model::describe() writes it)") from None
    raise ValueError(f"no Python twin for model '{name}'; kiln's Python twins are: mlp, gpt, "
                     "llama, exported")


def from_config(m):
    """The twin for the [model] table of a resolved kiln config (model.preset with any non-zero
    key overriding it, as kiln's resolve_gpt_config / resolve_llama_config; not model.init_from's
    config.json)."""
    if m["name"] == "llama":
        preset = Llama.PRESETS[m["preset"]]
        shape = dict(zip(LLAMA_KEYS + ("rope_theta",), preset))
        for key in shape:
            if m.get(key):
                shape[key] = m[key]
        return build({"name": "llama", **shape, "norm_eps": m.get("norm_eps") or 1e-5,
                      "tie_embeddings": m.get("tie_embeddings", False)})
    if m["name"] != "gpt":
        return build({"name": "mlp", "input_dim": m["input_dim"], "hidden_dim": m["hidden_dim"],
                      "num_classes": m["num_classes"],
                      "data_dependent_branch": m.get("data_dependent_branch", False)})
    shape = dict(zip(("n_layer", "n_head", "n_embd", "block_size", "vocab_size"),
                     Gpt.PRESETS[m["preset"]]))
    for key in shape:
        if m.get(key):
            shape[key] = m[key]
    return build({"name": m["name"], **shape})
