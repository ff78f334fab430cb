"""torchrun worker for test_example_sharded: the example GPT sharded by
spotrun.examples.parallel, trained a few steps, compared with the same GPT trained in one
process on the whole global batch (every rank computes that reference itself).

Usage: torchrun --nproc-per-node N sharded_gpt.py fsdp|tp|fsdp+tp OUT_DIR
Rank 0 writes OUT_DIR/result.json:
  tied_before, tied_after: the head's weight is the token embedding's parameter object
  parameters_once: the tied parameter is listed once by model.parameters()
  head_equals_embedding: in the gathered full state dict, head.weight == tok_emb.weight
  max_abs_diff: {name: largest |sharded - reference| over the gathered parameter}
  max_abs_param: largest |reference parameter| (the scale of the comparison)
  losses, reference_losses: per-step losses of the sharded run and the reference
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from exit_without_teardown import exit_without_teardown
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from spotrun.examples.gpt import GPT, GPTConfig
from spotrun.examples.parallel import Layout, Parallel
from spotrun.examples.train_gpt import GRAD_CLIP_NORM

STEPS = 3
PER_RANK_BATCH = 2
LR = 0.5
CONFIG = GPTConfig(block_size=16, width=32, depth=2, heads=2, dropout=0.0)

mode, out_dir = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo")
world_size = dist.get_world_size()
layout = Layout(world_size, tp=2 if "tp" in mode else 1, fsdp="fsdp" in mode)
layout.check(CONFIG.heads, distributed=True)
parallel = Parallel(layout, torch.device("cpu"))

generator = torch.Generator().manual_seed(7)
tokens = torch.randint(0, 256, (STEPS, layout.dp * PER_RANK_BATCH, CONFIG.block_size + 1), generator=generator)

torch.manual_seed(0)
reference = GPT(CONFIG)
torch.manual_seed(0)
model = GPT(CONFIG)
trained = parallel.wrap(model, torch.device("cpu"))
tied_before = model.head.weight is model.tok_emb.weight
parameters_once = sum(p is model.tok_emb.weight for p in model.parameters()) == 1

# Plain SGD, not the trainer's AdamW: AdamW divides each gradient by its own running scale, which
# turns rounding noise into full-size steps where the true gradient is (nearly) zero, so parameters
# would differ by far more than rounding (the example's key projection has no bias for that reason).
ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
opt = torch.optim.SGD(model.parameters(), lr=LR)
losses, reference_losses = [], []
mine = slice(parallel.dp_rank * PER_RANK_BATCH, (parallel.dp_rank + 1) * PER_RANK_BATCH)
for step in range(STEPS):
    x, y = tokens[step, :, :-1], tokens[step, :, 1:]  # (dp * B, T) each
    _, loss = reference(x, y)
    ref_opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), GRAD_CLIP_NORM)
    ref_opt.step()
    reference_losses.append(loss.item())

    _, loss = trained(x[mine], y[mine])
    opt.zero_grad()
    loss.backward()
    parallel.sync_gradients(model)
    parallel.clip_gradients(model, GRAD_CLIP_NORM)
    opt.step()
    losses.append(parallel.mean_over_dp(loss))

tied_after = model.head.weight is model.tok_emb.weight
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
expected = reference.state_dict()
result = {
    "tied_before": tied_before,
    "tied_after": tied_after,
    "parameters_once": parameters_once,
    "head_equals_embedding": torch.equal(full["head.weight"], full["tok_emb.weight"]),
    "names_match": sorted(full) == sorted(expected),
    "max_abs_diff": {name: (full[name] - expected[name]).abs().max().item() for name in expected if name in full},
    "max_abs_param": max(t.abs().max().item() for t in expected.values()),
    "losses": losses,
    "reference_losses": reference_losses,
}
if dist.get_rank() == 0:
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
exit_without_teardown(0)
