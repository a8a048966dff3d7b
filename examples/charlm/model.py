"""A character-level transformer language model in the manner of nanoGPT, sized for these
2-core CPUs: pre-norm blocks of causal self-attention and an MLP, learned positions, tied
input/output embeddings. Nothing here knows parle_hvd.

    model.target=examples/charlm/model.py:make_gpt  train.loss=examples/charlm/model.py:lm_loss
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int = 64, n_layer: int = 2, n_head: int = 4, n_embd: int = 64,
                 dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Parameter(torch.zeros(1, block_size, n_embd))
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight            # tied embeddings
        # True above the diagonal: a position attends to itself and the past only
        self.register_buffer("mask", torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), 1),
                             persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
        for b in self.blocks:                          # GPT-2's scaled init of the residual projections
            nn.init.normal_(b.mlp[2].weight, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx):                            # [B, T] token ids -> [B, T, vocab] logits
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:, :t]
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def _data():
    """data.py beside this file, whatever the working directory and sys.path."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("charlm_data", Path(__file__).with_name("data.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_gpt(block_size: int = 64, n_layer: int = 2, n_head: int = 4, n_embd: int = 64, dropout: float = 0.0):
    """The model for the corpus' characters (its vocabulary read from data.py)."""
    return CharGPT(len(_data().vocab()), block_size, n_layer, n_head, n_embd, dropout)


def lm_loss(logits, targets):
    """Mean next-character cross-entropy over every position of every sequence (nats)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
