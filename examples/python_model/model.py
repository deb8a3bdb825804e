"""A model of your own, in Python, for `kiln model import` (docs/models.md "your PyTorch model").

Not a transformer: a causal convolutional language model. Token embeddings go through `depth`
residual blocks, each a causal depthwise convolution over the sequence (each position sees the
`kernel` tokens up to itself, never later ones) and a gated MLP, then a final norm and a head.

kiln calls `build(**options)` once, in Python, when it imports the model, and trains the exported
graph from C++ afterwards; nothing here runs in the training loop.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalConvBlock(nn.Module):
    def __init__(self, width, kernel):
        super().__init__()
        self.kernel = kernel
        self.norm = nn.LayerNorm(width)
        self.conv = nn.Conv1d(width, width, kernel, groups=width)  # depthwise, over time
        self.gate = nn.Linear(width, 2 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):  # [B, T, C]
        h = self.norm(x).transpose(1, 2)              # [B, C, T]
        h = self.conv(F.pad(h, (self.kernel - 1, 0)))  # left padding only: causal
        a, b = self.gate(h.transpose(1, 2)).chunk(2, dim=-1)
        return x + self.out(F.silu(a) * b)


class ConvLM(nn.Module):
    """[B, T] token ids -> [B, T, vocab] logits."""

    def __init__(self, vocab=256, width=64, depth=2, kernel=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(CausalConvBlock(width, kernel) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(vocab=256, width=64, depth=2, kernel=4, seed=0):
    torch.manual_seed(seed)  # the initial weights the package holds
    return ConvLM(vocab, width, depth, kernel)
