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

:class:`Settings` checks every setting before anything runs (:class:`SettingsError`, one
line naming the flag); nothing is written unless training completed at least one step, and
both files are written to a temporary name and renamed into place, so an interrupted or
refused run never replaces the committed checkpoint.

    dsv4lab train --minutes 2.5 --device cuda --out data/checkpoints/mini.safetensors

Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv4lab import runtime
from dsv4lab.config import DSV4Config
from dsv4lab.model import DSV4, save_checkpoint, tiny_config

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "data" / "checkpoints" / "mini.safetensors"
HELDOUT_PERCENT = 5
SEPARATOR = b"\n\n"


class SettingsError(ValueError):
    """A training setting is out of range, or the corpus cannot serve it (one line)."""


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
        raise SettingsError(f"corpus too small: {n_train} train / {n_held} held-out files under "
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
    if layers is None or layers == cfg.num_layers:
        return cfg
    if layers < 2:
        raise SettingsError(f"--layers must be >= 2, got {layers}")
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
        "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list)),
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


@dataclass(frozen=True)
class Settings:
    """One training run, checked: every field in range, the device present."""
    minutes: float | None
    steps: int | None
    device: str
    out: Path
    log: Path
    config: str
    layers: int
    batch: int
    seq: int
    lr: float
    seed: int
    max_files: int | None
    threads: int | None
    quiet: bool

    @classmethod
    def from_args(cls, a) -> "Settings":
        """From the CLI's parsed arguments (``dsv4lab.cli``); :class:`SettingsError` names the
        first flag out of range."""
        def need(ok: bool, msg: str):
            if not ok:
                raise SettingsError(msg)

        need(a.steps is None or a.steps >= 1, f"--steps must be >= 1, got {a.steps}")
        need(a.minutes is None or (math.isfinite(a.minutes) and a.minutes > 0),
             f"--minutes must be a positive number, got {a.minutes}")
        for flag, v, lo in (("--batch", a.batch, 1), ("--seq", a.seq, 8), ("--layers", a.layers, 2),
                            ("--max-files", a.max_files, 1), ("--threads", a.threads, 1)):
            need(v is None or v >= lo, f"{flag} must be >= {lo}, got {v}")
        need(math.isfinite(a.lr) and a.lr > 0, f"--lr must be a positive number, got {a.lr}")
        device = a.device or str(runtime.device())
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError):
            raise SettingsError(f"--device {device!r} is not a device (cuda, cuda:N or cpu)") from None
        if dev.type == "cuda":
            need(torch.cuda.is_available(), f"--device {device}: this machine has no CUDA GPU (use --device cpu)")
            need(dev.index is None or dev.index < torch.cuda.device_count(),
                 f"--device {device}: there are {torch.cuda.device_count()} CUDA device(s)")
        else:
            need(dev.type == "cpu", f"--device must be cuda or cpu, got {device!r}")
        out = Path(a.out) if a.out else DEFAULT_OUT
        need(not out.is_dir(), f"--out {out} is a folder; give a file path (.safetensors)")
        gpu = dev.type == "cuda"
        minutes = a.minutes if a.minutes is not None else (None if a.steps else 2.5)
        return cls(minutes=minutes, steps=a.steps, device=device, out=out,
                   log=Path(a.log) if a.log else out.with_suffix(".json"), config=a.config,
                   layers=a.layers, batch=a.batch or (64 if gpu else 8), seq=a.seq or (512 if gpu else 256),
                   lr=a.lr, seed=a.seed, max_files=a.max_files, threads=a.threads, quiet=a.quiet)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run(s: Settings) -> int:
    """Train with ``s``; write the checkpoint and the log only when at least one step ran.
    Returns the exit status (1: nothing written)."""
    if s.threads:
        torch.set_num_threads(s.threads)
    cfg = mini_config(s.layers) if s.config == "mini" else tiny_config()
    model, log = train(cfg, minutes=s.minutes, steps=s.steps, device=s.device, batch=s.batch, seq=s.seq,
                       lr=s.lr, seed=s.seed, max_files=s.max_files, quiet=s.quiet)
    if log["steps"] < 1:
        print(f"dsv4lab train: no step ran within {s.minutes} min: nothing written ({s.out} kept)")
        return 1
    s.out.parent.mkdir(parents=True, exist_ok=True)
    s.log.parent.mkdir(parents=True, exist_ok=True)
    b, a = log["heldout_before_quant"], log["heldout_after_quant"]
    # save_checkpoint writes a temporary file and renames it over s.out once complete
    save_checkpoint(model.cpu(), s.out, metadata={
        "trained_on": log["device"], "steps": str(log["steps"]), "minutes": str(log["minutes"]),
        "heldout_main_loss_bf16_experts": f"{b['main']:.4f}",
        "heldout_main_loss_mxfp4_experts": f"{a['main']:.4f}",
    })
    log["checkpoint"] = s.out.name
    log["checkpoint_bytes"] = s.out.stat().st_size
    _write_atomic(s.log, json.dumps(log, indent=1))
    print(f"trained {log['steps']} steps in {log['minutes']:.2f} min on {log['device']}; "
          f"held-out loss (nats/byte) main {b['main']:.4f} -> {a['main']:.4f} after MXFP4, "
          f"MTP {b['mtp']:.4f} -> {a['mtp']:.4f}; top-1 main {a['main_acc']:.3f} "
          f"MTP {a['mtp_acc']:.3f}; {s.out} ({log['checkpoint_bytes'] / 1e6:.1f} MB), log {s.log}")
    return 0
