"""nanoGPT's shakespeare_char CPU run, in PyTorch, as the reference for `tpu-llm bench`.

The model is nanoGPT's `model.py` on its `bias=False` path (exact GELU, scaled_dot_product_attention,
tied head, GPT-2 init with scaled residual projections) and the loop is its `train.py` for the
published command (`--device=cpu --compile=False --eval_iters=20 --block_size=64 --batch_size=12
--n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0` on top of
`config/train_shakespeare_char.py`): random windows, AdamW(0.9, 0.99) with decay on 2-D weights,
warmup 100 then cosine to 1e-4, clipping at 1.0. After 2000 steps it prints nanoGPT's own estimate
(20 random batches per split) and the loss over the whole validation split in consecutive windows
(143 batches of 12), which is how `tpu-llm bench` evaluates (it stops after 140 of them).

Needs PyTorch (the `reference` extra installs a CPU build):
    python scripts/nanogpt_reference.py [SEED] [PATH/tinyshakespeare.txt]
(the text defaults to the copy shipped in tpu_llm/data/shipped/, which `tpu-llm bench` trains on)
"""

import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1337
path = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tpu_llm",
                                                          "shipped", "tinyshakespeare.txt")
torch.manual_seed(seed)
torch.set_num_threads(2)

text = open(path).read()
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
data = np.array([stoi[c] for c in text], dtype=np.int64)
train_data, val_data = data[:int(len(data) * 0.9)], data[int(len(data) * 0.9):]
B, T, L, H, C, V = 12, 64, 4, 4, 128, len(chars)
STEPS, LR, MIN_LR, WARMUP = 2000, 1e-3, 1e-4, 100


class LayerNorm(nn.Module):  # without bias
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = [z.view(b, t, H, c // H).transpose(1, 2) for z in self.c_attn(x).split(C, dim=2)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = LayerNorm(C), Attention(), LayerNorm(C)
        self.c_fc, self.c_proj = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks, self.ln_f = nn.ModuleList([Block() for _ in range(L)]), LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.wte.weight = self.lm_head.weight  # tied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * L))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def get_batch(split):
    d = train_data if split == "train" else val_data
    ix = torch.randint(len(d) - T, (B,))
    x = torch.stack([torch.from_numpy(d[i:i + T]) for i in ix])
    y = torch.stack([torch.from_numpy(d[i + 1:i + 1 + T]) for i in ix])
    return x, y


def get_lr(it):
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    ratio = (it - WARMUP) / (STEPS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


@torch.no_grad()
def estimate(split, iters=20):  # nanoGPT's estimate_loss with --eval_iters=20
    return torch.stack([model(*get_batch(split)) for _ in range(iters)]).mean().item()


@torch.no_grad()
def whole_validation():  # consecutive windows of T + 1 tokens in batches of B, as tpu-llm evaluates
    d = torch.from_numpy(val_data)
    w = d[:len(d) // (T + 1) * (T + 1)].view(-1, T + 1)
    losses = [model(w[i:i + B, :-1], w[i:i + B, 1:]).item() for i in range(0, len(w) - B + 1, B)]
    return sum(losses) / len(losses)


model = GPT()
params = list(model.parameters())
optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                               {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                              lr=LR, betas=(0.9, 0.99))
start = time.time()
for it in range(STEPS):
    for group in optimizer.param_groups:
        group["lr"] = get_lr(it)
    loss = model(*get_batch("train"))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
seconds = time.time() - start
model.eval()
print(f"seed {seed}, step {STEPS}: nanoGPT's estimate (20 batches) train {estimate('train'):.4f} "
      f"val {estimate('val'):.4f}; whole validation split {whole_validation():.4f}; "
      f"{1000 * seconds / STEPS:.1f} ms/step, {STEPS * B * T / seconds:,.0f} tokens/s")
