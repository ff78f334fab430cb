"""Unit tests of the example job's model, dataset and LR schedules (no torchrun, no checkpoints)."""

from __future__ import annotations

import json

import pytest
import torch

from spotrun.checkpoint.tree import encode
from spotrun.errors import ConfigError
from spotrun.examples.gpt import GPT, VOCAB_SIZE, GPTConfig
from spotrun.examples.stdlib_text import StdlibText, read_stdlib_bytes, stdlib_root, stdlib_source_files
from spotrun.examples.train_gpt import build_optimizer, build_scheduler

TINY = GPTConfig(block_size=16, width=32, depth=2, heads=4)
SMALL_TEXT_BYTES = 64 * 1024


def _model(config: GPTConfig = TINY, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


@pytest.fixture(scope="module")
def dataset() -> StdlibText:
    return StdlibText(block_size=16, max_bytes=SMALL_TEXT_BYTES)


# --- model -------------------------------------------------------------------


def test_forward_shapes_and_loss() -> None:
    model = _model()
    idx = torch.randint(0, VOCAB_SIZE, (3, 10))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 10, VOCAB_SIZE)
    assert loss.shape == () and torch.isfinite(loss)
    logits, loss = model(idx)
    assert logits.shape == (3, 10, VOCAB_SIZE) and loss is None


def test_longer_sequence_than_block_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        _model()(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


@pytest.mark.parametrize("bad", [dict(width=30, heads=4), dict(depth=0), dict(dropout=1.0)])
def test_bad_config_is_refused(bad: dict) -> None:
    with pytest.raises(ConfigError):
        GPTConfig(**bad)


def test_output_is_causal() -> None:
    model = _model().eval()
    idx = torch.randint(0, VOCAB_SIZE, (1, 12))
    changed = idx.clone()
    changed[0, 8] = (idx[0, 8] + 1) % VOCAB_SIZE
    before, _ = model(idx)
    after, _ = model(changed)
    torch.testing.assert_close(before[:, :8], after[:, :8])
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_head_weight_is_tied_to_token_embedding() -> None:
    model = _model()
    assert model.head.weight is model.tok_emb.weight
    state = model.state_dict()
    assert state["head.weight"].data_ptr() == state["tok_emb.weight"].data_ptr()
    # The tie survives loading a state dict, and the shared tensor is a single parameter.
    other = _model(seed=1)
    other.load_state_dict(state)
    assert other.head.weight is other.tok_emb.weight
    torch.testing.assert_close(other.head.weight, model.tok_emb.weight)
    names = [name for name, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names


def test_init_follows_the_global_seed() -> None:
    a, b, c = _model(seed=5), _model(seed=5), _model(seed=6)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_dropout_is_active_in_training_only() -> None:
    model = _model(GPTConfig(block_size=16, width=32, depth=1, heads=2, dropout=0.5))
    idx = torch.randint(0, VOCAB_SIZE, (2, 16))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])


def test_loss_decreases_when_training_on_real_text(dataset: StdlibText) -> None:
    model = _model()
    opt = build_optimizer(model, lr=3e-3, weight_decay=0.1)
    x = torch.stack([dataset[i][0] for i in range(8)])  # (8, 16)
    y = torch.stack([dataset[i][1] for i in range(8)])  # (8, 16)
    losses = []
    for _ in range(30):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Untrained, the loss is near ln(256) ~ 5.5; a few steps on one batch must cut it well down.
    assert losses[0] > 5.0
    assert losses[-1] < losses[0] - 1.5


# --- dataset -----------------------------------------------------------------


def test_dataset_is_real_stdlib_source(dataset: StdlibText) -> None:
    text = bytes(dataset.data.tolist())
    assert len(text) == SMALL_TEXT_BYTES
    assert b"def " in text and b"import " in text
    files = stdlib_source_files()
    assert files == sorted(files, key=lambda p: p.as_posix())
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)
    assert text.startswith((stdlib_root() / files[0]).read_bytes())


def test_dataset_is_deterministic(dataset: StdlibText) -> None:
    again = StdlibText(block_size=16, max_bytes=SMALL_TEXT_BYTES)
    assert torch.equal(again.data, dataset.data)
    assert read_stdlib_bytes(1000) == bytes(dataset.data[:1000].tolist())


def test_samples_are_consecutive_windows_shifted_by_one(dataset: StdlibText) -> None:
    block = dataset.block_size
    assert len(dataset) == (SMALL_TEXT_BYTES - 1) // block
    for i in (0, 1, len(dataset) - 2):
        x, y = dataset[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (block,)
        assert torch.equal(x, dataset.data[i * block : (i + 1) * block].long())
        assert torch.equal(y[:-1], x[1:])
        assert y[-1] == dataset[i + 1][0][0]
    last_x, last_y = dataset[len(dataset) - 1]
    assert last_y.shape == (block,)
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_dataset_refuses_bad_sizes() -> None:
    with pytest.raises(ConfigError):
        StdlibText(block_size=0)
    with pytest.raises(ConfigError):
        StdlibText(block_size=64, max_bytes=10)


# --- LR schedules --------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["onecycle", "cosine", "constant"])
@pytest.mark.parametrize("warmup_steps", [0, 5])
def test_schedule_state_is_plain_json_and_resumes(schedule: str, warmup_steps: int) -> None:
    def make():
        opt = build_optimizer(_model(GPTConfig(block_size=4, width=8, depth=1, heads=1)), 1e-3, 0.1)
        return opt, build_scheduler(opt, schedule, steps=20, warmup_steps=warmup_steps)

    opt, sched = make()
    lrs = []
    for _ in range(8):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    skeleton, tensors = encode(sched.state_dict(), "scheduler")  # raises on a non-JSON value
    assert tensors == {}
    assert max(lrs) <= 1e-3 * (1 + 1e-9)
    if warmup_steps:
        assert lrs[0] < lrs[warmup_steps]

    opt2, resumed = make()
    opt2.load_state_dict(opt.state_dict())  # as a checkpoint restores both; lr lives in param_groups
    resumed.load_state_dict(json.loads(json.dumps(skeleton)))
    for _ in range(5):
        assert resumed.get_last_lr() == sched.get_last_lr()
        for o, s in ((opt, sched), (opt2, resumed)):
            o.step()
            s.step()
