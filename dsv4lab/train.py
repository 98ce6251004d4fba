"""``dsv4lab train``: train the mini DeepSeek-V4 (and its MTP layer) on Python's own source.

The corpus every machine has: the ``.py`` files of the running interpreter's standard
library (``sysconfig.get_paths()["stdlib"]``, site-packages excluded), read as bytes
(vocab 256). Files are split deterministically by a CRC32 of their relative path: about
5% are held out for evaluation. Training samples random windows of ``seq + 2`` bytes and
minimises next-byte cross-entropy + 0.3 x the MTP layer's byte-after-next cross-entropy
+ 0.1 x the lightning indexer's KL term (on detached inputs); the noaux_tc router biases
are nudged toward equal expert load every step.

After training the routed experts of every layer (main and MTP) are quantised to MXFP4
(:func:`dsv4lab.quant.mxfp4_quantize`) and the held-out loss is measured before and after.
Writes a safetensors checkpoint (packed experts, config in its metadata) and a JSON log
(settings, loss curve, held-out figures, device, steps, minutes).

    python -m dsv4lab.cli train --minutes 2.5 --device cuda --out data/checkpoints/mini.safetensors

Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv4lab import runtime
from dsv4lab.config import DSV4Config
from dsv4lab.model import DSV4, save_checkpoint, tiny_config

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "data" / "checkpoints" / "mini.safetensors"
HELDOUT_PERCENT = 5
SEPARATOR = b"\n\n"


# ------------------------------------------------------------------------------ corpus
def stdlib_files(root: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every .py file of the standard library, sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts):
            continue
        out.append((rel.as_posix(), f))
    return sorted(out)


def is_heldout(relpath: str) -> bool:
    """The deterministic split: CRC32 of the relative path, ~5% held out."""
    return zlib.crc32(relpath.encode()) % 100 < HELDOUT_PERCENT


def load_corpus(root=None, max_files: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """-> (train bytes uint8 [N], held-out bytes uint8 [M], info)."""
    files = stdlib_files(root)
    if max_files:
        files = files[:max_files]
    train, held = [], []
    n_train = n_held = 0
    for rel, f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if is_heldout(rel):
            held.append(data)
            n_held += 1
        else:
            train.append(data)
            n_train += 1
    if not train or not held:
        raise RuntimeError(f"corpus too small: {n_train} train / {n_held} held-out files under "
                           f"{root or sysconfig.get_paths()['stdlib']}")
    to_t = lambda parts: torch.frombuffer(bytearray(SEPARATOR.join(parts)), dtype=torch.uint8)  # noqa: E731
    tr, he = to_t(train), to_t(held)
    info = {"stdlib": str(root or sysconfig.get_paths()["stdlib"]), "python": platform.python_version(),
            "train_files": n_train, "heldout_files": n_held, "train_bytes": tr.numel(),
            "heldout_bytes": he.numel(), "heldout_percent": HELDOUT_PERCENT}
    return tr, he, info


def mini_config(layers: int | None = None) -> DSV4Config:
    """``DSV4Config.mini()``, optionally with ``layers`` main layers laid out like Flash:
    ``[0, 0] + [4, 128] * ...`` (then the MTP layer's 0)."""
    cfg = DSV4Config.mini()
    if not layers or layers == cfg.num_layers:
        return cfg
    if layers < 2:
        raise ValueError(f"--layers must be >= 2, got {layers}")
    body = ([4, 128] * layers)[:layers - 2]
    return cfg.replace(num_layers=layers, compress_ratios=tuple([0, 0] + body + [cfg.mtp_compress_ratio]))


def heldout_windows(held: torch.Tensor, seq: int, n: int) -> torch.Tensor:
    """``n`` evenly spaced windows of ``seq + 2`` bytes of the held-out stream: [n, seq+2]."""
    span = held.numel() - seq - 2
    starts = torch.linspace(0, max(span, 0), n).long()
    return torch.stack([held[s:s + seq + 2] for s in starts]).long()


# ------------------------------------------------------------------------------ eval
@torch.no_grad()
def evaluate(model: DSV4, windows: torch.Tensor, *, batch: int = 16, device=None) -> dict:
    """Held-out main/MTP cross-entropy (nats per byte) and top-1 accuracy."""
    model.eval()
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    tot = {"main": 0.0, "mtp": 0.0, "main_acc": 0.0, "mtp_acc": 0.0}
    n = 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch].to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits, streams, _ = model.forward_train(w[:, :-2])
            mlog, _ = model.mtp_forward_train(streams, w[:, 1:-1])
        V = logits.shape[-1]
        k = w.shape[0]
        tot["main"] += F.cross_entropy(logits.float().reshape(-1, V), w[:, 1:-1].reshape(-1)).item() * k
        tot["mtp"] += F.cross_entropy(mlog.float().reshape(-1, V), w[:, 2:].reshape(-1)).item() * k
        tot["main_acc"] += (logits.argmax(-1) == w[:, 1:-1]).float().mean().item() * k
        tot["mtp_acc"] += (mlog.argmax(-1) == w[:, 2:]).float().mean().item() * k
        n += k
    model.train()
    return {key: v / n for key, v in tot.items()}


# ------------------------------------------------------------------------------ train
def _lr(step: int, progress: float, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(cfg: DSV4Config, *, minutes: float | None, steps: int | None, device, batch: int,
          seq: int, lr: float, seed: int, max_files: int | None = None, eval_windows: int = 64,
          log_every: int = 10, quiet: bool = False) -> tuple[DSV4, dict]:
    """Train; return (the model with MXFP4 experts, the log dict)."""
    dev = torch.device(device)
    torch.manual_seed(seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tr, he, info = load_corpus(max_files=max_files)
    tr_dev = tr.to(dev)
    held = heldout_windows(he, seq, eval_windows)
    model = DSV4(cfg).to(dev).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    budget = minutes * 60 if minutes else None
    max_steps = steps or (10 ** 9 if budget else 1000)
    warmup = min(100, max(10, max_steps // 20)) if steps else 100
    curve = []
    t0 = time.perf_counter()
    step = 0
    ar = torch.arange(seq + 2, device=dev)
    while step < max_steps:
        elapsed = time.perf_counter() - t0
        if budget and elapsed >= budget:
            break
        progress = max(step / max_steps if steps else 0.0, elapsed / budget if budget else 0.0)
        cur_lr = _lr(step, progress, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        starts = torch.randint(0, tr.numel() - seq - 2, (batch,), generator=gen).to(dev)
        x = tr_dev[starts[:, None] + ar].long()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            losses = model.loss(x)
        opt.zero_grad(set_to_none=True)
        losses["total"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.update_router_bias()
        step += 1
        if step % log_every == 0 or step == 1:
            row = {"step": step, "seconds": round(time.perf_counter() - t0, 2), "lr": cur_lr,
                   **{k: round(float(v.detach()), 4) for k, v in losses.items()}}
            curve.append(row)
            if not quiet:
                print(f"step {step:5d}  {row['seconds']:7.1f}s  loss {row['main']:.3f}  "
                      f"mtp {row.get('mtp', 0):.3f}  idx {row['indexer']:.3f}  lr {cur_lr:.2e}",
                      flush=True)
    train_s = time.perf_counter() - t0
    before = evaluate(model, held, device=dev)
    model.quantize_experts("mxfp4")
    after = evaluate(model, held, device=dev)
    log = {
        "config": json.loads(json.dumps(cfg.__dict__, default=list)),
        "device": runtime.device_name() if dev.type == "cuda" else "cpu",
        "device_type": dev.type, "versions": runtime.versions(),
        "steps": step, "minutes": round(train_s / 60, 3), "batch": batch, "seq": seq, "lr": lr,
        "seed": seed, "tokens_seen": step * batch * seq, "corpus": info,
        "eval_windows": eval_windows,
        "heldout_before_quant": before, "heldout_after_quant": after,
        "expert_format": "mxfp4", "curve": curve,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return model, log


def main(argv=None) -> int:
    """Entry point of ``dsv4lab train``."""
    ap = argparse.ArgumentParser(prog="dsv4lab train", description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=None, help="time budget (default 2.5 unless --steps)")
    ap.add_argument("--steps", type=int, default=None, help="number of optimizer steps")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: the lab's device)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="checkpoint path (.safetensors)")
    ap.add_argument("--log", default=None, help="JSON log path (default: next to --out)")
    ap.add_argument("--config", default="mini", choices=["mini", "tiny"])
    ap.add_argument("--layers", type=int, default=8,
                    help="main layers of the mini config (default 8: [0,0]+[4,128]*3, like Flash's "
                         "pattern; the draft's cost relative to the model is what speculation trades)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 64 on GPU, 8 on CPU)")
    ap.add_argument("--seq", type=int, default=None, help="bytes per sequence (default 512 on GPU, 256 on CPU)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-files", type=int, default=None, help="use only the first N files (quick runs)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    device = args.device or str(runtime.device())
    gpu = device.startswith("cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    minutes = args.minutes if args.minutes is not None else (None if args.steps else 2.5)
    cfg = mini_config(args.layers) if args.config == "mini" else tiny_config()
    model, log = train(cfg, minutes=minutes, steps=args.steps, device=device,
                       batch=args.batch or (64 if gpu else 8), seq=args.seq or (512 if gpu else 256),
                       lr=args.lr, seed=args.seed, max_files=args.max_files, quiet=args.quiet)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = Path(args.log) if args.log else out.with_suffix(".json")
    b, a = log["heldout_before_quant"], log["heldout_after_quant"]
    save_checkpoint(model.cpu(), out, metadata={
        "trained_on": log["device"], "steps": str(log["steps"]), "minutes": str(log["minutes"]),
        "heldout_main_loss_bf16_experts": f"{b['main']:.4f}",
        "heldout_main_loss_mxfp4_experts": f"{a['main']:.4f}",
    })
    log["checkpoint"] = out.name
    log["checkpoint_bytes"] = out.stat().st_size
    log_path.write_text(json.dumps(log, indent=1))
    print(f"trained {log['steps']} steps in {log['minutes']:.2f} min on {log['device']}; "
          f"held-out loss (nats/byte) main {b['main']:.4f} -> {a['main']:.4f} after MXFP4, "
          f"MTP {b['mtp']:.4f} -> {a['mtp']:.4f}; top-1 main {a['main_acc']:.3f} "
          f"MTP {a['mtp_acc']:.3f}; {out} ({log['checkpoint_bytes'] / 1e6:.1f} MB), log {log_path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
