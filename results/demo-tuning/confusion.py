"""Zero-shot confusion matrix, accuracy per object size and a nearest-centroid check of a run.

    .venv/bin/python results/demo-tuning/confusion.py RUN_DIR
"""
import sys, torch, torch.nn.functional as F, numpy as np
from PIL import Image
import io
torch.set_num_threads(1)
from vlcontrast.models import load_model_from_checkpoint
from vlcontrast.evaluation.zeroshot import build_zeroshot_classifier
from vlcontrast.data.prep.synthetic import SHAPES, TEMPLATES, make_sample
b = load_model_from_checkpoint(sys.argv[1])
m = b.model.eval(); tf = b.preprocess_val
clf = build_zeroshot_classifier(m, b.tokenizer, SHAPES, TEMPLATES)
imgs, labels, sizes = [], [], []
for c, shape in enumerate(SHAPES):
    for i in range(50):
        jpeg, cap, meta = make_sample(0, "zeroshot", c*1_000_000+i, 64, shape=shape)
        imgs.append(tf(Image.open(io.BytesIO(jpeg)).convert("RGB"))); labels.append(c); sizes.append(meta["objects"][0]["size"])
with torch.no_grad():
    f = F.normalize(m.encode_image(torch.stack(imgs)).float(), dim=-1)
pred = (f @ clf).argmax(1).numpy(); labels=np.array(labels); sizes=np.array(sizes)
print("top1", (pred==labels).mean())
for s in ("small","medium","large"): print(s, (pred==labels)[sizes==s].mean().round(3), (sizes==s).sum())
cm = np.zeros((10,10),int)
for p,l in zip(pred,labels): cm[l,p]+=1
print("      "+" ".join(s[:5].rjust(5) for s in SHAPES))
for i,s in enumerate(SHAPES): print(s[:6].ljust(6), " ".join(str(x).rjust(5) for x in cm[i]))
# image-only shape info: nearest class centroid with leave-one-out
cent = torch.stack([f[torch.tensor(labels)==c].mean(0) for c in range(10)])
print("image-centroid acc (in-sample)", ((f@F.normalize(cent,dim=-1).t()).argmax(1).numpy()==labels).mean())
