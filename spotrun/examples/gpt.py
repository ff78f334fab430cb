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
from spotrun.examples.keyed_dropout import SampleKeys, SiteDropout

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
    """Multi-head self-attention where position t sees positions <= t only.

    Queries, keys and values have one projection each, so tensor parallelism can shard them
    column-wise into whole heads (``ColwiseParallel``) and ``proj`` row-wise: a rank then
    holds ``H / N`` heads and this module finds its local head count from the projected width.
    ``head_offset`` is the first global head this rank holds (0 without tensor parallelism;
    set by :func:`spotrun.examples.parallel.apply_tensor_parallel`); only sample-keyed
    dropout needs it.
    """

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.heads = config.heads
        self.head_width = config.width // config.heads
        self.head_offset = 0
        self.q = nn.Linear(config.width, config.width)
        # No key bias: softmax ignores a shift shared by a row of scores, so its true gradient is
        # zero and AdamW would turn the rounding noise of that gradient into full-size steps (a
        # resume was then exact in every tensor but this one, whose values were amplified noise).
        self.k = nn.Linear(config.width, config.width, bias=False)
        self.v = nn.Linear(config.width, config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.attn_dropout = SiteDropout(config.dropout, site=1 + 3 * layer)
        self.resid_dropout = SiteDropout(config.dropout, site=2 + 3 * layer)

    def forward(self, x: torch.Tensor, keys: SampleKeys | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape  # (B, T, C)
        # (B, T, h * C/H) -> (B, h, T, C/H), h = H on one rank, H / N under N-way tensor parallelism
        q, k, v = (t.view(batch, seq, -1, self.head_width).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        if keys is None or not self.training or self.attn_dropout.p == 0.0:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.attn_dropout.p if self.training else 0.0, is_causal=True
            )  # (B, h, T, C/H)
        else:
            y = self._attention_with_keyed_dropout(q, k, v, keys)  # (B, h, T, C/H)
        y = y.transpose(1, 2).reshape(batch, seq, -1)  # (B, T, h * C/H)
        return self.resid_dropout(self.proj(y), keys)  # (B, T, C)

    def _attention_with_keyed_dropout(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: SampleKeys
    ) -> torch.Tensor:
        """Causal attention whose weights (B, h, T, T) are dropped by sample-keyed masks drawn
        for all H heads, of which this rank keeps its own ``h``."""
        local_heads, seq = q.shape[1], q.shape[2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_width)  # (B, h, T, T)
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)  # (T, T)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)  # (B, h, T, T)
        keep = keys.keep_mask(self.attn_dropout.site, (self.heads, seq, seq), self.attn_dropout.p, q.device)
        keep = keep[:, self.head_offset : self.head_offset + local_heads]  # (B, h, T, T)
        weights = weights * keep / (1.0 - self.attn_dropout.p)
        return weights @ v  # (B, h, T, C/H)


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wider inside, GELU activation."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.proj = nn.Linear(4 * config.width, config.width)
        self.dropout = SiteDropout(config.dropout, site=3 + 3 * layer)

    def forward(self, x: torch.Tensor, keys: SampleKeys | None = None) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))), keys)  # (B, T, C)


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_mlp = nn.LayerNorm(config.width)
        self.mlp = MLP(config, layer)

    def forward(self, x: torch.Tensor, keys: SampleKeys | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x), keys)  # (B, T, C)
        return x + self.mlp(self.ln_mlp(x), keys)  # (B, T, C)


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
        self.emb_dropout = SiteDropout(config.dropout, site=0)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.depth))
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

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, dropout_keys: SampleKeys | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-byte logits, and the mean cross-entropy loss if ``targets`` is given.

        Args:
            idx: (B, T) int64 byte values, T <= ``config.block_size``.
            targets: (B, T) int64 next bytes, or ``None``.
            dropout_keys: the B samples' keys: dropout masks then come from them
                (:class:`~spotrun.examples.keyed_dropout.SampleKeys`) instead of the global
                torch generator; ``None`` for ordinary dropout.

        Returns:
            ``(logits, loss)``: logits (B, T, V) float; loss a scalar tensor, or ``None``.

        Raises:
            ConfigError: T exceeds ``config.block_size``.
        """
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ConfigError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        positions = torch.arange(seq, device=idx.device)  # (T,)
        x = self.emb_dropout(self.tok_emb(idx) + self.pos_emb(positions), dropout_keys)  # (B, T, C)
        for block in self.blocks:
            x = block(x, dropout_keys)  # (B, T, C)
        logits = self.head(self.ln_final(x))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, VOCAB_SIZE), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (the tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())
