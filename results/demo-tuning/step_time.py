"""Seconds per training step of the demo's model, eager or under torch.compile (README "Demo results").

    OMP_NUM_THREADS=1 .venv/bin/python results/demo-tuning/step_time.py CONTEXT_LENGTH COMPILE
    e.g. ... step_time.py 32 0   (eager)   ... step_time.py 32 1   (torch.compile)
         ... step_time.py 16 0   (text context of 16 tokens instead of 32)

Random inputs, batch 256, open_clip's ClipLoss and AdamW: the step's compute only, no data
loading. Prints the first step's time (which includes compilation) and the mean of 6 later steps.
"""
import sys
import time

import open_clip
import torch

from vlcontrast.models import _register_config, resolve_model_config, use_channels_last

torch.manual_seed(0)
context, compile_it = int(sys.argv[1]), sys.argv[2] == "1"
name, cfg = resolve_model_config("vlc-rn-tiny-32")
cfg["text_cfg"]["context_length"] = context
model = open_clip.create_model(_register_config(f"{name}-ctx{context}", cfg), output_dict=True)
use_channels_last(model)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
batch = 256
images = torch.randn(batch, 3, 32, 32).contiguous(memory_format=torch.channels_last)
texts = torch.randint(1, 1000, (batch, context))
loss_fn = open_clip.ClipLoss()
forward = torch.compile(model) if compile_it else model


def step():
    out = forward(images, texts)
    loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


start = time.time()
step()
print(f"first step {time.time() - start:.2f} s")
for _ in range(2):
    step()
start = time.time()
for _ in range(6):
    step()
print(f"context {context} compile {compile_it}: {(time.time() - start) / 6:.3f} s a step")
