"""A small GPT-style language model over bytes (vocabulary of 256 tokens).

Shapes use ``B`` = batch size, ``T`` = sequence length (<= ``block_size``),
``C`` = embedding width, ``H`` = number of heads, ``V`` = vocabulary size (256).

The output head shares its weight with the token embedding (weight tying), so the
model's ``state_dict()`` holds two names for one tensor: a checkpoint must store it
once and restore it without breaking the tie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spotrun.errors import ConfigError

#: Tokens are bytes.
VOCAB_SIZE = 256


@dataclass(frozen=True)
class GPTConfig:
    """Model size and regularisation.

    Attributes:
        block_size: longest sequence the model accepts (number of learned positions).
        width: embedding width ``C``; must be divisible by ``heads``.
        depth: number of transformer blocks.
        heads: attention heads per block.
        dropout: dropout probability on embeddings, attention weights and residual branches.

    Raises:
        ConfigError: a size is not positive, ``width`` is not divisible by ``heads``, or
            ``dropout`` is outside [0, 1).
    """

    block_size: int = 128
    width: int = 128
    depth: int = 2
    heads: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("block_size", "width", "depth", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.width % self.heads:
            raise ConfigError(f"GPTConfig.width ({self.width}) must be divisible by heads ({self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(width, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, H, T, C/H)
        y = y.transpose(1, 2).reshape(batch, seq, width)  # (B, T, C)
        return self.resid_dropout(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wider inside, GELU activation."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.proj = nn.Linear(4 * config.width, config.width)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))  # (B, T, C)
        return x + self.mlp(self.ln_mlp(x))  # (B, T, C)


class GPT(nn.Module):
    """Byte-level GPT: token + position embeddings, ``depth`` blocks, tied output head.

    Initialisation draws from the global torch generator, so ``torch.manual_seed(s)``
    before construction gives the same weights on every rank.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(VOCAB_SIZE, config.width)
        self.pos_emb = nn.Embedding(config.block_size, config.width)
        self.emb_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.ln_final = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, VOCAB_SIZE, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one (V, C) tensor, two names
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # Residual-branch outputs add up over 2 * depth branches; shrink them to keep
        # the residual stream's variance independent of depth.
        residual_std = 0.02 / math.sqrt(2 * self.config.depth)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-byte logits, and the mean cross-entropy loss if ``targets`` is given.

        Args:
            idx: (B, T) int64 byte values, T <= ``config.block_size``.
            targets: (B, T) int64 next bytes, or ``None``.

        Returns:
            ``(logits, loss)``: logits (B, T, V) float; loss a scalar tensor, or ``None``.

        Raises:
            ConfigError: T exceeds ``config.block_size``.
        """
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ConfigError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        positions = torch.arange(seq, device=idx.device)  # (T,)
        x = self.emb_dropout(self.tok_emb(idx) + self.pos_emb(positions))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.head(self.ln_final(x))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, VOCAB_SIZE), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (the tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())
