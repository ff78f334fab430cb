"""The simulated model: a decoder-only transformer (Llama's layout, as torchtitan names it) of a
given size, its parameters' shapes, and how tensor parallelism cuts each one."""

from __future__ import annotations

from dataclasses import dataclass, replace

#: Llama 3's published shapes: (parameters, layers, hidden, FFN, vocabulary, attention heads, KV heads).
PRESETS = (
    (8e9, 32, 4096, 14336, 128256, 32, 8),
    (70e9, 80, 8192, 28672, 128256, 64, 8),
    (405e9, 126, 16384, 53248, 128256, 128, 8),
)


@dataclass(frozen=True)
class ModelShape:
    """Layers, widths and vocabulary of the simulated transformer."""

    layers: int
    hidden: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int

    @property
    def kv_width(self) -> int:
        """Rows of the K and V projections: KV heads x head width (grouped-query attention)."""
        return self.kv_heads * (self.hidden // self.heads)

    def parameters(self) -> list[tuple[str, tuple[int, ...], str]]:
        """``(name, shape, tp)`` of every parameter in ``model.state_dict()`` order; ``tp`` is how
        tensor parallelism cuts it as torchtitan does: ``"dim0"`` (ColwiseParallel linears, the
        RowwiseParallel embedding), ``"dim1"`` (RowwiseParallel linears) or ``"replicate"`` (norms)."""
        h, f, kv = self.hidden, self.ffn, self.kv_width
        found: list[tuple[str, tuple[int, ...], str]] = [("tok_embeddings.weight", (self.vocab, h), "dim0")]
        for i in range(self.layers):
            p = f"layers.{i}."
            found += [
                (p + "attention.wq.weight", (h, h), "dim0"),
                (p + "attention.wk.weight", (kv, h), "dim0"),
                (p + "attention.wv.weight", (kv, h), "dim0"),
                (p + "attention.wo.weight", (h, h), "dim1"),
                (p + "feed_forward.w1.weight", (f, h), "dim0"),
                (p + "feed_forward.w2.weight", (h, f), "dim1"),
                (p + "feed_forward.w3.weight", (f, h), "dim0"),
                (p + "attention_norm.weight", (h,), "replicate"),
                (p + "ffn_norm.weight", (h,), "replicate"),
            ]
        return found + [("norm.weight", (h,), "replicate"), ("output.weight", (self.vocab, h), "dim0")]

    def parameter_count(self) -> int:
        count = 0
        for _, shape, _ in self.parameters():
            n = 1
            for d in shape:
                n *= d
            count += n
        return count


def shape_for(params: float, **overrides: int | None) -> ModelShape:
    """The preset nearest ``params`` (by ratio), with any of its fields overridden."""
    preset = min(PRESETS, key=lambda p: max(p[0], params) / min(p[0], params))
    shape = ModelShape(*preset[1:])
    return replace(shape, **{k: v for k, v in overrides.items() if v is not None})
